"""The simulator backend: a CUDA driver made of host memory, host clocks and numpy kernels.

Chosen only explicitly (``CUDALAB_SIMULATOR=1`` or :func:`cudalab.use_simulator`); every
device it shows says "simulated". It exists so that cudalab's upper layers (allocator,
streams, events, magics, widgets) can be developed and tested on machines without a GPU,
and so that tests can create situations a real GPU makes hard to arrange (work that is
deliberately "not yet complete", a device that runs out of memory at a chosen size).

Configuration (environment, read when :class:`SimulatorBackend` is constructed):

``CUDALAB_SIMULATOR_DEVICES``
    Number of simulated devices, a whole number from 1 to 64 (default 2).
``CUDALAB_SIMULATOR_MEMORY``
    Memory per device: plain bytes (``1073741824``) or a number with a unit, case-insensitive,
    optional space, decimals allowed: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000),
    ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); e.g. ``16GiB`` (default), ``1.5GiB``,
    ``512 MiB``. Between 1 MiB and 1 TiB.
``CUDA_VISIBLE_DEVICES``
    Honoured like the driver does (see :func:`parse_visible_devices`). NVML ignores it.

Model:

* **Memory.** Each device is one anonymous private ``mmap`` of its capacity with
  ``MAP_NORESERVE``, created on the first allocation and committed lazily by the kernel, so an
  idle 16 GiB device costs nothing. Device pointers are fake addresses
  ``0xA000_0000_0000 + ordinal * 2**40 + offset``: above the 47-bit user address space (they
  can never alias a real host pointer) and below ``2**53`` (exact in JSON/JS). A best-fit
  sub-allocator with coalescing hands out 512-byte granules (2 MiB aligned from 2 MiB up) and
  enforces the capacity. Large frees ``madvise(MADV_DONTNEED)`` the pages back to the OS.
  Copies translate fake pointers to the mapping and check that device ranges lie inside a
  live allocation; any other address is taken as a host address if it is a plausible
  user-space address. :meth:`SimulatorBackend.host_view` and :meth:`SimulatorBackend.array`
  expose memory to kernels and tests.
* **Virtual memory (VMM).** :meth:`SimulatorBackend.vmm_reserve` hands out address ranges
  from a region of its own above every device's range (``_VMM_BASE`` to ``2**53``), each
  range backed by its own lazily committed ``MAP_NORESERVE`` mapping so that translation
  stays linear; reservations are separated by at least one unmapped 2 MiB granule, so no
  access can run from one into the next. Physical memory from
  :meth:`SimulatorBackend.vmm_create` counts against the device's capacity (shared with
  ``mem_alloc`` and pools). Mapped ranges are usable by copies, fills, kernels, ``array`` and
  ``pointer_device`` (also across adjacent mappings); unmapped ones are refused like freed
  memory. Unmapping discards the contents (``MADV_DONTNEED``): a handle mapped again reads
  zeros, where a real GPU would keep its data. One handle can be mapped at one place at a time
  (a second mapping raises ``CUDA_ERROR_NOT_SUPPORTED``).
* **Stream-ordered pools.** A pool takes chunks (multiples of 2 MiB) from the device's
  sub-allocator and serves allocations from them best fit (512-byte granules); freed memory
  stays cached in the pool (an unlimited release threshold) until ``pool_trim`` or
  ``pool_destroy``. ``mem_free_async`` returns memory to its pool when the stream reaches the
  free. Usage counts allocations rounded up to 512 bytes.
* **Streams.** Each stream is a FIFO of operations that normally runs at once, in the
  caller's thread. The simulator-only test hooks :meth:`SimulatorBackend.pause_stream` and
  :meth:`SimulatorBackend.resume_stream` hold a stream's work back so that tests can observe
  "not yet complete" states. Event waits and the legacy default stream's implicit
  synchronisation with blocking streams are modelled as queue dependencies. Synchronising on
  work that can never run (a paused stream, or a wait on an event pending on one) raises
  :class:`RuntimeError` instead of hanging.
* **Events** read ``time.perf_counter_ns`` when their stream reaches them.
* **Kernels** are Python callables registered by name with :func:`register_kernel`; they are
  called as ``impl(sim, grid, block, shared_mem, *args)`` where ``sim`` is the backend.
* **NVML** is :class:`SimulatedNvml`, with values derived from the simulator's state.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import itertools
import mmap
import operator
import os
import re
import struct
import sys
import threading
import time
import uuid as _uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from cudalab._driver.base import (
    EVENT_BLOCKING_SYNC,
    EVENT_DISABLE_TIMING,
    EVENT_INTERPROCESS,
    IPC_HANDLE_SIZE,
    STREAM_DEFAULT,
    STREAM_NON_BLOCKING,
    Backend,
    DeviceInfo,
    KernelArgs,
    Nvml,
)
from cudalab.errors import CudaError, NvmlError, OutOfMemoryError

__all__ = [
    "SimulatorBackend",
    "SimulatedNvml",
    "register_kernel",
    "parse_visible_devices",
    "FAKE_BASE",
    "DEVICE_STRIDE",
]

# ------------------------------------------------------------------------------- constants
#: First fake device address (device 0, offset 0).
FAKE_BASE = 0xA000_0000_0000
#: Distance between two devices' fake address ranges (also the largest device size).
DEVICE_STRIDE = 1 << 40
#: Most simulated devices (and the most CUDALAB_SIMULATOR_DEVICES accepts).
MAX_DEVICES = 64
_FAKE_END = FAKE_BASE + MAX_DEVICES * DEVICE_STRIDE  # < 2**53
#: Virtual memory (vmm_reserve) lives above every device's range, below 2**53.
_VMM_BASE = _FAKE_END
_VMM_END = 1 << 53
_VMM_GRANULARITY = 2 << 20
_USER_LIMIT = 1 << 47  # end of the x86-64/aarch64 (48-bit VA) user address space
_PAGE = mmap.PAGESIZE
_GRANULE = 512
_LARGE = 2 << 20
_MADVISE_MIN = 64 << 10
_MIN_MEMORY = 1 << 20
_MAX_MEMORY = DEVICE_STRIDE

_DEFAULT_DEVICES = 2
_DEFAULT_MEMORY = "16GiB"

_PRIORITY_LEAST, _PRIORITY_GREATEST = 0, -5
_MAX_SHARED_OPTIN = 227 << 10
_BLOCK_LIMITS = (1024, 1024, 64)
_GRID_LIMITS = (2**31 - 1, 65535, 65535)

_IPC_MAGIC = b"CLSIMEVT"
_IPC_VERSION = 1
_IPC_STRUCT = struct.Struct("<8sIIQQ")  # magic, version, flags, pid, event id

_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)

_UUID_NAMESPACE = _uuid.uuid5(_uuid.NAMESPACE_URL, "https://cudalab.invalid/simulator/gpu")

_now = time.perf_counter_ns
_handles = itertools.count(1)
_ipc_ids = itertools.count(1)
_HANDLE_BASE = 0x5A00_0000_0000


def _next_handle() -> int:
    return _HANDLE_BASE + next(_handles) * 0x40


# ---------------------------------------------------------------------------------- errors
def _invalid_value(call: str, detail: str | None = None) -> CudaError:
    msg = "invalid argument" if not detail else f"invalid argument ({detail})"
    return CudaError(1, "CUDA_ERROR_INVALID_VALUE", msg, call=call)


def _invalid_handle(call: str, detail: str | None = None) -> CudaError:
    msg = "invalid resource handle" if not detail else f"invalid resource handle ({detail})"
    return CudaError(400, "CUDA_ERROR_INVALID_HANDLE", msg, call=call)


def _invalid_device(call: str, detail: str | None = None) -> CudaError:
    msg = "invalid device ordinal" if not detail else f"invalid device ordinal {detail}"
    return CudaError(101, "CUDA_ERROR_INVALID_DEVICE", msg, call=call)


def _out_of_memory(call: str, message: str = "out of memory") -> OutOfMemoryError:
    return OutOfMemoryError(2, "CUDA_ERROR_OUT_OF_MEMORY", message, call=call)


# ---------------------------------------------------------------------- configuration
def _device_uuid(physical: int) -> str:
    """The deterministic NVML-style UUID of simulated device ``physical``."""
    return "GPU-" + str(_uuid.uuid5(_UUID_NAMESPACE, f"cudalab-simulated-gpu-{physical}"))


def _strtoul(text: str) -> int:
    """The leading (optionally signed) decimal number of ``text``, or -1 (torch's helper)."""
    end = 0
    for i, c in enumerate(text):
        if c in "0123456789" or (i == 0 and c in "+-"):
            end = i + 1
        else:
            break
    try:
        return int(text[:end]) if end else -1
    except ValueError:  # a lone sign
        return -1


def parse_visible_devices(value: str, count: int) -> list[int]:
    """Physical device indices selected by a ``CUDA_VISIBLE_DEVICES`` value.

    Follows the driver as torch's ``_parse_visible_devices`` mimics it: a comma list of
    indices, each read like ``strtoul`` (``"1gpu2"`` reads as 1, ``"+3"`` as 3); parsing stops
    at the first entry that is not a non-negative number or not an existing device (index
    ``>= count``); a repeated index makes the whole list empty; an empty string selects no
    device. A value starting with ``GPU-`` is a list of UUIDs or unique UUID prefixes matched
    against the simulated devices' UUIDs (the first unknown or ambiguous one stops parsing);
    ``MIG-`` values select nothing (the simulator has no MIG instances).
    """
    count = operator.index(count)
    text = value.strip()
    if text.startswith("MIG-"):
        return []
    if text.startswith("GPU-"):
        uuids = [_device_uuid(i) for i in range(count)]
        chosen: list[int] = []
        for elem in text.split(","):
            cand = elem.strip()
            if not cand.startswith("GPU-"):
                break
            cand = "GPU-" + cand[4:].lower()
            matches = [i for i, u in enumerate(uuids) if u.startswith(cand)]
            if len(matches) != 1:
                break
            if matches[0] in chosen:
                return []
            chosen.append(matches[0])
        return chosen
    parsed: list[int] = []
    for elem in value.split(","):
        x = _strtoul(elem.strip())
        if x in parsed:
            return []
        if x < 0:
            break
        parsed.append(x)
    for i, x in enumerate(parsed):
        if x >= count:
            return parsed[:i]
    return parsed


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)$")


def _parse_size(text: str) -> int | None:
    m = _SIZE_RE.match(text.strip())
    if not m:
        return None
    factor = _UNITS.get(m.group(2).lower())
    if factor is None:
        return None
    return int(Fraction(m.group(1)) * factor)


def _read_device_count() -> int:
    raw = os.environ.get("CUDALAB_SIMULATOR_DEVICES")
    if raw is None or not raw.strip():
        return _DEFAULT_DEVICES
    text = raw.strip()
    if re.fullmatch(r"\+?\d+", text):
        n = int(text)
        if 1 <= n <= MAX_DEVICES:
            return n
    raise ValueError(
        f"CUDALAB_SIMULATOR_DEVICES={raw!r} is not understood; give the number of simulated "
        f"devices as a whole number from 1 to {MAX_DEVICES}, e.g. CUDALAB_SIMULATOR_DEVICES=2"
    )


def _read_memory() -> int:
    raw = os.environ.get("CUDALAB_SIMULATOR_MEMORY")
    if raw is None or not raw.strip():
        raw = _DEFAULT_MEMORY
    size = _parse_size(raw)
    if size is None or not _MIN_MEMORY <= size <= _MAX_MEMORY:
        raise ValueError(
            f"CUDALAB_SIMULATOR_MEMORY={raw!r} is not understood; give the memory per simulated "
            "device as bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            "between 1MiB and 1TiB, e.g. 16GiB, 1.5GiB, 512 MiB, 8GB or 1073741824"
        )
    return size


# --------------------------------------------------------------------------- kernel registry
_KERNELS: dict[str, Callable[..., None]] = {}
_KERNELS_LOCK = threading.Lock()


def register_kernel(name: str, impl: Callable[..., None] | None = None):
    """Register the simulator implementation of kernel ``name``.

    ``impl(sim, grid, block, shared_mem, *args)`` is called when the kernel runs, with
    ``sim`` the :class:`SimulatorBackend` (use ``sim.array(ptr, dtype, count)`` to reach device
    memory) and ``args`` the launch's argument values. Usable directly,
    ``register_kernel("axpy", fn)``, or as a decorator, ``@register_kernel("axpy")``. A later
    registration of the same name replaces the earlier one for modules looked up afterwards.
    """
    if not isinstance(name, str) or not name:
        raise TypeError("register_kernel: the kernel name must be a non-empty str")

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        if not callable(fn):
            raise TypeError(f"register_kernel({name!r}): the implementation must be callable")
        with _KERNELS_LOCK:
            _KERNELS[name] = fn
        return fn

    return decorate if impl is None else decorate(impl)


# ------------------------------------------------------------------------------ handles
class _Stream:
    __slots__ = ("backend", "device", "handle", "flags", "priority", "is_null", "is_per_thread",
                 "legacy", "queue", "lock", "paused", "draining", "destroyed", "__weakref__")

    def __init__(self, backend, device: int, handle: int, flags: int, priority: int, null: bool):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.flags = flags
        self.priority = priority
        self.is_null = null
        self.is_per_thread = False
        # The legacy default stream and blocking streams synchronise with each other.
        self.legacy = null or not (flags & STREAM_NON_BLOCKING)
        self.queue: collections.deque = collections.deque()
        self.lock = threading.RLock()
        self.paused = False
        self.draining = 0  # ident of the thread running this stream's operations, or 0
        self.destroyed = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        kind = ("null stream" if self.is_null else "per-thread default stream"
                if self.is_per_thread else f"stream 0x{self.handle:x}")
        return f"<simulated {kind} on device {self.device}>"


class _Event:
    __slots__ = ("backend", "device", "handle", "flags", "epoch", "done", "ts", "rec_stream",
                 "destroyed", "ipc_key", "target", "__weakref__")

    def __init__(self, backend, device: int, handle: int, flags: int):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.flags = flags
        self.epoch = 0  # records requested
        self.done = 0  # latest record completed
        self.ts = 0
        self.rec_stream: _Stream | None = None
        self.destroyed = False
        self.ipc_key: tuple[int, int] | None = None
        self.target: _Event | None = None  # an IPC handle opened in its own process

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated event 0x{self.handle:x} on device {self.device}>"


class _Wait:
    """A queue entry: later work on the stream waits until ``event`` reaches ``epoch``."""

    __slots__ = ("event", "epoch", "stream")

    def __init__(self, event: _Event, epoch: int, stream: _Stream | None):
        self.event = event
        self.epoch = epoch
        self.stream = stream  # where the awaited record is queued


class _Module:
    __slots__ = ("backend", "device", "handle", "size", "unloaded")

    def __init__(self, backend, device: int, handle: int, size: int):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.size = size
        self.unloaded = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated module 0x{self.handle:x} on device {self.device} ({self.size} bytes)>"


class _Function:
    __slots__ = ("module", "name", "impl", "handle")

    def __init__(self, module: _Module, name: str, impl: Callable[..., None], handle: int):
        self.module = module
        self.name = name
        self.impl = impl
        self.handle = handle

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated kernel {self.name!r} on device {self.module.device}>"


_INT_RANGES = {
    "p": (0, 2**64 - 1),
    "i4": (-(2**31), 2**31 - 1),
    "u4": (0, 2**32 - 1),
    "i8": (-(2**63), 2**63 - 1),
    "u8": (0, 2**64 - 1),
}
_FLOAT_TYPES = ("f4", "f8")
_F4 = struct.Struct("<f")


class _SimArgs(KernelArgs):
    """Kernel arguments for the simulator: validated Python numbers."""

    __slots__ = ("signature", "_values")

    def __init__(self, signature: tuple[str, ...]):
        self.signature = signature
        self._values = tuple(0.0 if t in _FLOAT_TYPES else 0 for t in signature)

    def set(self, *values: Any) -> _SimArgs:
        sig = self.signature
        if len(values) != len(sig):
            raise ValueError(
                f"kernel takes {len(sig)} argument(s) ({', '.join(sig) or 'none'}), "
                f"got {len(values)}"
            )
        out = []
        for i, (t, v) in enumerate(zip(sig, values)):
            if t in _FLOAT_TYPES:
                if isinstance(v, (str, bytes, complex)) or not hasattr(v, "__float__"):
                    raise TypeError(f"kernel argument {i} ({t}) must be a real number, "
                                    f"not {type(v).__name__}")
                f = float(v)
                if t == "f4":
                    try:
                        f = _F4.unpack(_F4.pack(f))[0]
                    except OverflowError:
                        raise ValueError(f"kernel argument {i} ({t}) {v!r} is out of range "
                                         "for float32") from None
                out.append(f)
            else:
                try:
                    n = operator.index(v)
                except TypeError:
                    raise TypeError(f"kernel argument {i} ({t}) must be an int, "
                                    f"not {type(v).__name__}") from None
                lo, hi = _INT_RANGES[t]
                if not lo <= n <= hi:
                    raise ValueError(f"kernel argument {i} ({t}) {n} is out of range "
                                     f"[{lo}, {hi}]")
                out.append(n)
        self._values = tuple(out)
        return self

    @property
    def values(self) -> tuple:
        return self._values

    def __repr__(self) -> str:
        return f"<simulated kernel args {self.signature} = {self._values}>"


# ------------------------------------------------------------------------------ devices
class _Device:
    """One simulated device: its memory mapping, sub-allocator and streams."""

    def __init__(self, ordinal: int, physical: int, capacity: int):
        self.ordinal = ordinal
        self.physical = physical
        self.capacity = capacity
        self.usable = capacity // _GRANULE * _GRANULE
        self.base = FAKE_BASE + ordinal * DEVICE_STRIDE
        self.mm: mmap.mmap | None = None
        self.addr = 0
        self.free_offs: list[int] = []  # sorted offsets of free blocks
        self.free_size: dict[int, int] = {}
        self.free_by_size: list[tuple[int, int]] = []  # sorted (size, offset) of free blocks
        self.alloc_offs: list[int] = []  # sorted offsets of live allocations
        self.alloc_size: dict[int, int] = {}
        self.async_freeing: set[int] = set()  # offsets with a stream-ordered free queued
        self.used = 0
        self.touched = False
        self.null: _Stream | None = None
        self.streams: set[_Stream] = set()
        self.info: DeviceInfo | None = None
        if self.usable:
            self._add_free(0, self.usable)

    def _add_free(self, off: int, size: int) -> None:
        bisect.insort(self.free_offs, off)
        self.free_size[off] = size
        bisect.insort(self.free_by_size, (size, off))

    def _remove_free(self, off: int) -> int:
        size = self.free_size.pop(off)
        del self.free_offs[bisect.bisect_left(self.free_offs, off)]
        del self.free_by_size[bisect.bisect_left(self.free_by_size, (size, off))]
        return size

    def take(self, size: int) -> int | None:
        """Best fit (smallest free block that holds ``size`` at the required alignment,
        lowest offset among equals): the offset of the new allocation, or None when full."""
        align = _LARGE if size >= _LARGE else _GRANULE
        by_size = self.free_by_size
        for j in range(bisect.bisect_left(by_size, (size, -1)), len(by_size)):
            fsize, off = by_size[j]
            start = (off + align - 1) & -align
            end = start + size
            fend = off + fsize
            if end > fend:
                continue
            self._remove_free(off)
            if start > off:
                self._add_free(off, start - off)
            if fend > end:
                self._add_free(end, fend - end)
            bisect.insort(self.alloc_offs, start)
            self.alloc_size[start] = size
            self.used += size
            return start
        return None

    def release(self, off: int) -> tuple[int, int, int]:
        """Free the allocation at ``off``; returns (size, coalesced start, coalesced end)."""
        size = self.alloc_size.pop(off)
        del self.alloc_offs[bisect.bisect_left(self.alloc_offs, off)]
        self.used -= size
        start, end = off, off + size
        offs = self.free_offs
        j = bisect.bisect_left(offs, off)
        if j > 0:
            prev = offs[j - 1]
            if prev + self.free_size[prev] == start:
                start = prev
                self._remove_free(prev)
        if end in self.free_size:
            end += self._remove_free(end)
        self._add_free(start, end - start)
        return size, start, end

    def find(self, off: int, nbytes: int) -> bool:
        """Whether [off, off + nbytes) lies inside one live allocation."""
        offs = self.alloc_offs
        i = bisect.bisect_right(offs, off) - 1
        if i < 0:
            return False
        a = offs[i]
        return off + nbytes <= a + self.alloc_size[a]


class _VmmHandle:
    """Physical memory from :meth:`SimulatorBackend.vmm_create` (a CUmemGenericAllocationHandle).

    Its capacity returns to the device once it is released and unmapped, in either order.
    """

    __slots__ = ("backend", "dev", "handle", "size", "released", "mapped", "freed")

    def __init__(self, backend, dev: _Device, handle: int, size: int):
        self.backend = backend
        self.dev = dev
        self.handle = handle
        self.size = size
        self.released = False
        self.mapped = False
        self.freed = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        state = ("freed" if self.freed else "released, still mapped" if self.released
                 else "mapped" if self.mapped else "unmapped")
        return (f"<simulated physical memory handle 0x{self.handle:x} on device "
                f"{self.dev.ordinal} ({self.size} bytes, {state})>")


class _VmmRange:
    """One reservation from :meth:`SimulatorBackend.vmm_reserve` and its mappings."""

    __slots__ = ("start", "size", "device", "mm", "addr", "maps", "map_starts")

    def __init__(self, start: int, size: int, device: int, mm: mmap.mmap):
        self.start = start
        self.size = size
        self.device = device
        self.mm = mm
        self.addr = _address_of(mm)
        self.maps: dict[int, tuple[int, _VmmHandle]] = {}  # start -> (size, handle)
        self.map_starts: list[int] = []  # sorted


class _Pool:
    """A stream-ordered memory pool (cuMemPoolCreate) with an unlimited release threshold.

    Chunks (multiples of 2 MiB) come from the device's sub-allocator; inside them a best-fit
    allocator (512-byte granules, coalescing within one chunk only, so idle chunks can be
    given back) serves allocations. Offsets are relative to the device's fake base.
    """

    __slots__ = ("backend", "dev", "handle", "destroyed", "chunks", "chunk_offs", "free_size",
                 "free_end", "free_by_size", "allocs", "freeing", "reserved", "reserved_high",
                 "used", "used_high")

    def __init__(self, backend, dev: _Device, handle: int):
        self.backend = backend
        self.dev = dev
        self.handle = handle
        self.destroyed = False
        self.chunks: dict[int, int] = {}  # offset -> size, in creation order
        self.chunk_offs: list[int] = []  # sorted
        self.free_size: dict[int, int] = {}  # free block offset -> size
        self.free_end: dict[int, int] = {}  # free block end -> offset
        self.free_by_size: list[tuple[int, int]] = []  # sorted (size, offset)
        self.allocs: dict[int, int] = {}  # live allocation offset -> size
        self.freeing: set[int] = set()  # offsets with a stream-ordered free queued
        self.reserved = self.reserved_high = self.used = self.used_high = 0

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        state = " (destroyed)" if self.destroyed else ""
        return (f"<simulated memory pool 0x{self.handle:x} on device {self.dev.ordinal}: "
                f"{self.used} of {self.reserved} bytes used{state}>")

    def _add_free(self, off: int, size: int) -> None:
        self.free_size[off] = size
        self.free_end[off + size] = off
        bisect.insort(self.free_by_size, (size, off))

    def _remove_free(self, off: int) -> int:
        size = self.free_size.pop(off)
        del self.free_end[off + size]
        del self.free_by_size[bisect.bisect_left(self.free_by_size, (size, off))]
        return size

    def take(self, size: int) -> int | None:
        """Best fit (lowest offset among equals); None when no cached block holds ``size``."""
        by_size = self.free_by_size
        j = bisect.bisect_left(by_size, (size, -1))
        if j == len(by_size):
            return None
        fsize, off = by_size[j]
        self._remove_free(off)
        if fsize > size:
            self._add_free(off + size, fsize - size)
        self.allocs[off] = size
        self.used += size
        if self.used > self.used_high:
            self.used_high = self.used
        return off

    def add_chunk(self, off: int, size: int) -> None:
        self.chunks[off] = size
        bisect.insort(self.chunk_offs, off)
        self.reserved += size
        if self.reserved > self.reserved_high:
            self.reserved_high = self.reserved
        self._add_free(off, size)

    def give(self, off: int) -> None:
        """Return the allocation at ``off`` to the pool's cache (coalescing in its chunk)."""
        size = self.allocs.pop(off)
        self.used -= size
        chunk = self.chunk_offs[bisect.bisect_right(self.chunk_offs, off) - 1]
        chunk_end = chunk + self.chunks[chunk]
        start, end = off, off + size
        prev = self.free_end.get(start)
        if prev is not None and prev >= chunk:
            self._remove_free(prev)
            start = prev
        if end < chunk_end and end in self.free_size:
            end += self._remove_free(end)
        self._add_free(start, end - start)

    def idle_chunks(self) -> list[int]:
        """Offsets of chunks with nothing allocated, the most recently created first."""
        return [c for c in reversed(self.chunks) if self.free_size.get(c) == self.chunks[c]]

    def drop_chunk(self, off: int) -> None:
        self._remove_free(off)
        self.reserved -= self.chunks.pop(off)
        del self.chunk_offs[bisect.bisect_left(self.chunk_offs, off)]


# ------------------------------------------------------------------------------ backend
class SimulatorBackend(Backend):
    """A simulated CUDA driver (see the module documentation for the model).

    Besides the :class:`~cudalab._driver.base.Backend` interface it offers, for kernels and
    tests: :meth:`host_view`, :meth:`array`, and the simulator-only test hooks
    :meth:`pause_stream` / :meth:`resume_stream`.
    """

    name = "simulator"
    simulated = True

    def __init__(self) -> None:
        self._n_total = _read_device_count()
        self._capacity = _read_memory()
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = (list(range(self._n_total)) if cvd is None
                   else parse_visible_devices(cvd, self._n_total))
        self._devs = [_Device(i, phys, self._capacity) for i, phys in enumerate(visible)]
        self._by_physical = {dev.physical: dev for dev in self._devs}
        self._uuids = [_device_uuid(i) for i in range(self._n_total)]
        for dev in self._devs:
            dev.null = _Stream(self, dev.ordinal, 0, STREAM_DEFAULT, 0, null=True)
        self._initialized = False
        self._tls = threading.local()
        # Memory bookkeeping: one re-entrant lock; a free re-entering from a finalizer while
        # this thread is mid-update is deferred until the update ends.
        self._mem_lock = threading.RLock()
        self._mem_busy = False
        self._deferred_frees: list[tuple[int, bool]] = []
        self._host: dict[int, tuple[mmap.mmap, int]] = {}
        self._host_starts: list[int] = []
        self._host_graveyard: list[mmap.mmap] = []
        # Virtual memory reservations by start address, and the stream-ordered pools'
        # live allocations and chunks by device address.
        self._vmm_ranges: dict[int, _VmmRange] = {}
        self._vmm_starts: list[int] = []
        self._pool_ptrs: dict[int, _Pool] = {}
        self._pool_chunks: dict[int, _Pool] = {}
        # Streams with queued operations, and a counter bumped whenever an event completes.
        self._pending: set[_Stream] = set()
        self._stream_handles: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._record_seq = 0
        self._ipc_events: dict[int, _Event] = {}
        self._peers: set[tuple[int, int]] = set()
        # (start ns, end ns, kind) of recent work per physical device, for NVML utilisation.
        self._activity = [collections.deque(maxlen=4096) for _ in range(self._n_total)]
        self._nvml: SimulatedNvml | None = None

    def __repr__(self) -> str:
        return (f"<SimulatorBackend: {len(self._devs)} visible of {self._n_total} simulated "
                f"devices, {self._capacity} bytes each>")

    # ------------------------------------------------------------ lifecycle and identity
    def init(self) -> None:
        self._initialized = True

    def driver_version(self) -> int:
        return 13000

    def device_count(self) -> int:
        return len(self._devs)

    def device_info(self, device: int) -> DeviceInfo:
        d = self._device(device, "cuDeviceGetAttribute")
        dev = self._devs[d]
        if dev.info is None:
            phys = dev.physical
            dev.info = DeviceInfo(
                ordinal=d,
                name="cudalab simulated GPU (H100-like)",
                major=9,
                minor=0,
                total_memory=dev.capacity,
                multi_processor_count=132,
                uuid=self._uuids[phys],
                pci_bus_id=f"0000:{0x18 + phys:02x}:00.0",
                pci_domain_id=0,
                pci_device_id=0,
                l2_cache_size=50 << 20,
                max_threads_per_multi_processor=2048,
                max_threads_per_block=1024,
                warp_size=32,
                regs_per_multiprocessor=65536,
                shared_memory_per_block=48 << 10,
                shared_memory_per_block_optin=227 << 10,
                shared_memory_per_multiprocessor=228 << 10,
                clock_rate=1980000,
                memory_clock_rate=2619000,
                memory_bus_width=5120,
                is_integrated=False,
                is_multi_gpu_board=False,
                unified_addressing=True,
                simulated=True,
                extra={"physical_index": phys, "pci_bus": 0x18 + phys,
                       "backend": "cudalab simulator"},
            )
        return dev.info

    def handle_int(self, handle: Any) -> int:
        if isinstance(handle, (_Stream, _Event, _Module, _Function)):
            return handle.handle
        return 0 if handle is None else int(handle)

    # ------------------------------------------------------------ contexts
    def set_context(self, device: int) -> None:
        d = self._device(device, "cuCtxSetCurrent")
        self._tls.device = d
        self._devs[d].touched = True

    def synchronize(self, device: int) -> None:
        d = self._device(device, "cuCtxSynchronize")
        dev = self._devs[d]
        for s in [dev.null, *list(dev.streams)]:
            self._sync_stream(s)

    def can_access_peer(self, device: int, peer: int) -> bool:
        d = self._device(device, "cuDeviceCanAccessPeer")
        p = self._device(peer, "cuDeviceCanAccessPeer")
        return d != p

    def enable_peer_access(self, device: int, peer: int) -> None:
        d = self._device(device, "cuCtxEnablePeerAccess")
        p = self._device(peer, "cuCtxEnablePeerAccess")
        if d == p:
            raise _invalid_device("cuCtxEnablePeerAccess")
        self._devs[d].touched = True
        self._peers.add((d, p))

    # ------------------------------------------------------------ memory
    def mem_alloc(self, device: int, nbytes: int) -> int:
        return self._alloc(device, nbytes, "cuMemAlloc")

    def mem_free(self, device: int, ptr: int) -> None:
        """Free a device allocation (0 is ignored). Like cuMemFree it first lets queued work
        run, but it does not wait for work held back by :meth:`pause_stream`."""
        self._device(device, "cuMemFree")
        if not ptr:
            return
        if self._pending:
            self._pump()
        self._free(ptr, "cuMemFree")

    def mem_alloc_async(self, device: int, nbytes: int, stream: Any) -> int:
        self._device(device, "cuMemAllocAsync")
        self._stream(stream, "cuMemAllocAsync")
        return self._alloc(device, nbytes, "cuMemAllocAsync")

    def mem_free_async(self, device: int, ptr: int, stream: Any) -> None:
        call = "cuMemFreeAsync"
        self._device(device, call)
        s = self._stream(stream, call)
        p = self._ptr(ptr, call)
        if not p:
            return
        with self._mem_lock:
            pool = self._pool_ptrs.get(p)
            if pool is not None:  # a pool allocation: back to its pool in stream order
                off = p - pool.dev.base
                if off in pool.freeing:
                    raise _invalid_value(call)
                pool.freeing.add(off)
            else:
                loc = self._alloc_start(p)
                if loc is None or loc[1] in loc[0].async_freeing or p in self._pool_chunks:
                    raise _invalid_value(call)
                loc[0].async_freeing.add(loc[1])
        self._submit(s, self._free, (p, call, True))

    def mem_get_info(self, device: int) -> tuple[int, int]:
        d = self._device(device, "cuMemGetInfo")
        dev = self._devs[d]
        dev.touched = True
        return dev.capacity - dev.used, dev.capacity

    def host_alloc(self, nbytes: int) -> int:
        call = "cuMemHostAlloc"
        n = self._size(nbytes, call)
        if n == 0:
            return 0
        size = -(-n // _PAGE) * _PAGE
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise _out_of_memory(call, f"out of memory ({exc})") from None
        addr = _address_of(mm)
        with self._mem_lock:
            self._host[addr] = (mm, n)
            bisect.insort(self._host_starts, addr)
            self._flush_graveyard()
        return addr

    def host_free(self, ptr: int) -> None:
        call = "cuMemFreeHost"
        p = self._ptr(ptr, call)
        if not p:
            return
        if self._pending:
            self._pump()
        with self._mem_lock:
            entry = self._host.pop(p, None)
            if entry is None:
                raise _invalid_value(call)
            del self._host_starts[bisect.bisect_left(self._host_starts, p)]
            # Work held back on a paused stream may still reference the buffer: keep the
            # mapping until nothing is queued rather than risk a use-after-unmap crash.
            self._host_graveyard.append(entry[0])
            self._flush_graveyard()

    def memcpy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        call = "cuMemcpy"
        d = self._device(device, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        hd = self._addr(self._ptr(dst, call), n, call)
        hs = self._addr(self._ptr(src, call), n, call)
        self._sync_op(d, self._copy_op, (hd, hs, n, self._devs[d].physical))

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyAsync"
        self._device(device, call)
        s = self._stream(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        hd = self._addr(self._ptr(dst, call), n, call)
        hs = self._addr(self._ptr(src, call), n, call)
        self._submit(s, self._copy_op, (hd, hs, n, self._devs[s.device].physical))

    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: Any
    ) -> None:
        call = "cuMemcpyPeerAsync"
        dd = self._device(dst_device, call)
        sd = self._device(src_device, call)
        s = self._stream(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        pd, ps = self._ptr(dst, call), self._ptr(src, call)
        if self._owner(pd) != dd:
            raise _invalid_value(call, f"destination 0x{pd:x} is not memory of device {dd}")
        if self._owner(ps) != sd:
            raise _invalid_value(call, f"source 0x{ps:x} is not memory of device {sd}")
        hd = self._addr(pd, n, call)
        hs = self._addr(ps, n, call)
        self._submit(s, self._copy_op, (hd, hs, n, self._devs[s.device].physical))

    def memset_d8(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        call = "cuMemsetD8"
        d = self._device(device, call)
        v = self._fill_value(value, 8, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        h = self._addr(self._ptr(ptr, call), n, call)
        self._sync_op(d, self._memset8_op, (h, v, n, self._devs[d].physical))

    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        call = "cuMemsetD8Async"
        self._device(device, call)
        s = self._stream(stream, call)
        v = self._fill_value(value, 8, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        h = self._addr(self._ptr(ptr, call), n, call)
        self._submit(s, self._memset8_op, (h, v, n, self._devs[s.device].physical))

    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: Any) -> None:
        call = "cuMemsetD32Async"
        self._device(device, call)
        s = self._stream(stream, call)
        v = self._fill_value(value, 32, call)
        n = self._size(count, call)
        p = self._ptr(ptr, call)
        if p % 4:
            raise _invalid_value(call, "pointer must be 4-byte aligned")
        if n == 0:
            return
        h = self._addr(p, 4 * n, call)
        self._submit(s, self._memset32_op, (h, v, n, self._devs[s.device].physical))

    def pointer_device(self, ptr: int) -> int | None:
        """The ordinal owning ``ptr`` when it lies in a live simulated allocation, else None
        (like cuPointerGetAttribute, which fails for freed or foreign addresses)."""
        try:
            p = operator.index(ptr)
        except TypeError:
            return None
        d = self._owner(p)
        if d is None:
            return None
        if p >= _VMM_BASE:  # _owner answers only for mapped virtual memory
            return d
        dev = self._devs[d]
        with self._mem_lock:
            return d if dev.find(p - dev.base, 1) else None

    # -- memory helpers for kernels and tests
    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of ``nbytes`` at ``ptr`` (device or host address).

        Device ranges must lie inside one live allocation (else CudaError INVALID_VALUE). The
        view does not keep the memory alive: do not use it after freeing the allocation.
        """
        n = self._size(nbytes, "host_view")
        p = self._ptr(ptr, "host_view")
        if n == 0:
            return memoryview(bytearray())
        addr = self._addr(p, n, "host_view")
        return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")

    def array(self, ptr: int, dtype: Any, count: int):
        """A writable 1-D numpy view of ``count`` elements of ``dtype`` at ``ptr``."""
        import numpy as np

        dt = np.dtype(dtype)
        c = operator.index(count)
        if c < 0:
            raise ValueError(f"array: count must be >= 0, got {c}")
        if c == 0:
            return np.zeros(0, dtype=dt)
        return np.frombuffer(self.host_view(ptr, c * dt.itemsize), dtype=dt, count=c)

    # ------------------------------------------------------------ streams
    def null_stream(self, device: int) -> Any:
        return self._devs[self._device(device, "cuStreamGetNull")].null

    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> Any:
        call = "cuStreamCreateWithPriority"
        d = self._device(device, call)
        f = operator.index(flags)
        if f not in (STREAM_DEFAULT, STREAM_NON_BLOCKING):
            raise _invalid_value(call, f"unknown stream flags {f}")
        p = min(_PRIORITY_LEAST, max(_PRIORITY_GREATEST, operator.index(priority)))
        s = _Stream(self, d, _next_handle(), f, p, null=False)
        dev = self._devs[d]
        dev.streams.add(s)
        self._stream_handles[s.handle] = s
        dev.touched = True
        return s

    def stream_from_int(self, device: int, value: int) -> Any:
        """The stream whose C value is ``value``: 0 and 1 (CU_STREAM_LEGACY) are ``device``'s
        null stream, 2 (CU_STREAM_PER_THREAD) the calling thread's per-thread default stream of
        ``device``, anything else must be the value of a live stream of this simulator (other
        libraries' streams do not exist here: CudaError INVALID_HANDLE)."""
        call = "cuStreamFromInt"
        d = self._device(device, call)
        v = operator.index(value)
        if v in (0, 1):
            return self._devs[d].null
        if v == 2:
            per_thread = getattr(self._tls, "per_thread", None)
            if per_thread is None:
                per_thread = self._tls.per_thread = {}
            s = per_thread.get(d)
            if s is None:
                # Blocking: the per-thread default stream synchronises with the legacy stream.
                s = per_thread[d] = _Stream(self, d, 2, STREAM_DEFAULT, 0, null=False)
                s.is_per_thread = True
                self._devs[d].streams.add(s)
            return s
        s = self._stream_handles.get(v)
        if s is None or s.destroyed:
            raise _invalid_handle(call, f"0x{v:x} is not a stream of this simulator")
        return s

    def stream_destroy(self, stream: Any) -> None:
        """Destroy a stream. Work still queued on it (a paused stream) stays queued and runs
        when :meth:`resume_stream` is given the destroyed handle."""
        call = "cuStreamDestroy"
        s = self._stream(stream, call)
        if s.is_null or s.is_per_thread:
            raise _invalid_handle(call, "a default stream cannot be destroyed")
        with s.lock:
            s.destroyed = True
            if not s.queue and not s.draining:
                self._devs[s.device].streams.discard(s)

    def stream_query(self, stream: Any) -> bool:
        s = self._stream(stream, "cuStreamQuery")
        if s.queue:
            self._pump()
        return not s.queue and not s.draining

    def stream_synchronize(self, stream: Any) -> None:
        """Wait until ``stream`` is idle.

        Raises RuntimeError (instead of hanging) when the stream can never become idle: it
        is paused with :meth:`pause_stream`, or waits for an event pending on such a stream.
        """
        self._sync_stream(self._stream(stream, "cuStreamSynchronize"))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        call = "cuStreamWaitEvent"
        s = self._stream(stream, call)
        ev = self._event(event, call)
        epoch = ev.epoch
        if ev.done >= epoch:
            return
        with s.lock:
            s.queue.append(_Wait(ev, epoch, ev.rec_stream))
            self._pending.add(s)
        if ev.done >= epoch:  # completed meanwhile in another thread
            self._pump()

    def stream_priority(self, stream: Any) -> int:
        return self._stream(stream, "cuStreamGetPriority").priority

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        self._device(device, "cuCtxGetStreamPriorityRange")
        return _PRIORITY_LEAST, _PRIORITY_GREATEST

    def stream_is_capturing(self, stream: Any) -> bool:
        self._stream(stream, "cuStreamIsCapturing")
        return False

    # -- simulator-only test hooks
    def pause_stream(self, stream: Any) -> None:
        """Simulator-only test hook: hold back work submitted to ``stream`` from now on.

        Operations queue up (``stream_query`` is False, events recorded on it stay pending)
        until :meth:`resume_stream`. An operation already running in another thread finishes.
        Synchronising on a paused stream raises RuntimeError.
        """
        s = self._stream(stream, "pause_stream", allow_destroyed=True)
        with s.lock:
            s.paused = True

    def resume_stream(self, stream: Any) -> None:
        """Simulator-only test hook: run ``stream``'s queued work in order, then anything that
        waited for it (streams waiting on its events, the legacy default stream)."""
        s = self._stream(stream, "resume_stream", allow_destroyed=True)
        with s.lock:
            s.paused = False
        self._pump()

    # ------------------------------------------------------------ events
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> Any:
        call = "cuEventCreate"
        d = self._device(device, call)
        f = operator.index(flags)
        if f & ~(EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS) or f < 0:
            raise _invalid_value(call, f"unknown event flags {f}")
        if f & EVENT_INTERPROCESS and not f & EVENT_DISABLE_TIMING:
            raise _invalid_value(call, "EVENT_INTERPROCESS requires EVENT_DISABLE_TIMING")
        ev = _Event(self, d, _next_handle(), f)
        if f & EVENT_INTERPROCESS:
            eid = next(_ipc_ids)
            ev.ipc_key = (os.getpid(), eid)
            self._ipc_events[eid] = ev
        self._devs[d].touched = True
        return ev

    def event_destroy(self, event: Any) -> None:
        ev = self._event_handle(event, "cuEventDestroy")
        ev.destroyed = True
        if ev.ipc_key is not None and ev.target is None:
            self._ipc_events.pop(ev.ipc_key[1], None)

    def event_record(self, event: Any, stream: Any) -> None:
        call = "cuEventRecord"
        ev = self._event(event, call)
        s = self._stream(stream, call)
        if ev.device != s.device:
            raise _invalid_handle(call, "event and stream belong to different devices")
        epoch = ev.epoch = ev.epoch + 1
        ev.rec_stream = s
        self._submit(s, self._record_op, (ev, epoch))

    def event_query(self, event: Any) -> bool:
        ev = self._event(event, "cuEventQuery")
        if ev.done >= ev.epoch:
            return True
        if self._pending:
            self._pump()
        return ev.done >= ev.epoch

    def event_synchronize(self, event: Any) -> None:
        """Wait until the event completes; RuntimeError if it is pending on a paused stream."""
        ev = self._event(event, "cuEventSynchronize")
        delay = 1e-4
        while ev.done < ev.epoch:
            self._pump()
            if ev.done >= ev.epoch:
                return
            s = ev.rec_stream
            reason = self._stuck_reason(s) if s is not None else None
            if reason:
                raise RuntimeError(f"simulator: event_synchronize({ev!r}) would wait forever: "
                                   f"{reason}")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def event_elapsed_time(self, start: Any, end: Any) -> float:
        call = "cuEventElapsedTime"
        a = self._event(start, call)
        b = self._event(end, call)
        for e in (a, b):
            if e.flags & EVENT_DISABLE_TIMING:
                raise _invalid_handle(call, f"{e!r} was created with EVENT_DISABLE_TIMING")
            if e.epoch == 0:
                raise _invalid_handle(call, f"{e!r} was never recorded")
        if (a.done < a.epoch or b.done < b.epoch) and self._pending:
            self._pump()
        if a.done < a.epoch or b.done < b.epoch:
            raise CudaError(600, "CUDA_ERROR_NOT_READY", "device not ready", call=call)
        return (b.ts - a.ts) / 1e6

    def ipc_event_handle(self, event: Any) -> bytes:
        call = "cuIpcGetEventHandle"
        ev = self._event_handle(event, call)
        if ev.ipc_key is None or not ev.flags & EVENT_INTERPROCESS:
            raise _invalid_value(call, "the event was not created with EVENT_INTERPROCESS")
        pid, eid = ev.ipc_key
        raw = _IPC_STRUCT.pack(_IPC_MAGIC, _IPC_VERSION, ev.flags, pid, eid)
        return raw + bytes(IPC_HANDLE_SIZE - len(raw))

    def ipc_open_event(self, device: int, handle: bytes) -> Any:
        """Open an event exported by :meth:`ipc_event_handle`.

        From another process the event always reports complete (its queue is not visible
        here); opened in the exporting process it follows the original event.
        """
        call = "cuIpcOpenEventHandle"
        d = self._device(device, call)
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"IPC event handle must be bytes-like, got {type(handle).__name__}")
        data = bytes(handle)
        if len(data) != IPC_HANDLE_SIZE:
            raise ValueError(f"IPC event handle must be {IPC_HANDLE_SIZE} bytes, got {len(data)}")
        magic, version, _flags, pid, eid = _IPC_STRUCT.unpack_from(data)
        if magic != _IPC_MAGIC or version != _IPC_VERSION or any(data[_IPC_STRUCT.size:]):
            raise _invalid_value(call, "not an IPC event handle of the cudalab simulator")
        ev = _Event(self, d, _next_handle(), EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
        ev.ipc_key = (pid, eid)
        if pid == os.getpid():
            target = self._ipc_events.get(eid)
            if target is not None and not target.destroyed:
                ev.target = target
                ev.device = target.device
        self._devs[d].touched = True
        return ev

    # ------------------------------------------------------------ modules and kernels
    def module_load(self, device: int, image: bytes) -> Any:
        """Accept any image (a CUBIN for a real GPU, PTX or source text); kernels are looked
        up by name in the simulator's registry (:func:`register_kernel`)."""
        call = "cuModuleLoadData"
        d = self._device(device, call)
        if isinstance(image, str):
            size = len(image.encode())
        elif isinstance(image, (bytes, bytearray, memoryview)):
            size = memoryview(image).nbytes
        else:
            raise _invalid_value(call, "the module image must be bytes")
        if size == 0:
            raise CudaError(200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid",
                            call=call)
        self._devs[d].touched = True
        return _Module(self, d, _next_handle(), size)

    def module_unload(self, module: Any) -> None:
        self._module(module, "cuModuleUnload").unloaded = True

    def module_function(self, module: Any, name: str) -> Any:
        call = "cuModuleGetFunction"
        m = self._module(module, call)
        impl = _KERNELS.get(name)
        if impl is None:
            raise CudaError(500, "CUDA_ERROR_NOT_FOUND",
                            f"no simulator implementation registered for kernel {name!r}",
                            call=call)
        return _Function(m, name, impl, _next_handle())

    def make_args(self, signature: Sequence[str]) -> KernelArgs:
        sig = tuple(signature)
        for t in sig:
            if t not in _INT_RANGES and t not in _FLOAT_TYPES:
                raise ValueError(f"unknown kernel parameter type {t!r}; use one of "
                                 "'p', 'i4', 'u4', 'i8', 'u8', 'f4', 'f8'")
        return _SimArgs(sig)

    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: KernelArgs,
    ) -> None:
        call = "cuLaunchKernel"
        if not isinstance(function, _Function) or function.module.backend is not self:
            raise _invalid_handle(call, "not a kernel of this simulator")
        if function.module.unloaded:
            raise _invalid_handle(call, "the kernel's module was unloaded")
        s = self._stream(stream, call)
        if s.device != function.module.device:
            raise _invalid_handle(call, "the kernel's module is loaded on another device")
        g = _dims(grid, _GRID_LIMITS, "grid", call)
        b = _dims(block, _BLOCK_LIMITS, "block", call)
        if b[0] * b[1] * b[2] > 1024:
            raise _invalid_value(call, f"block {b} has more than 1024 threads")
        smem = operator.index(shared_mem)
        if not 0 <= smem <= _MAX_SHARED_OPTIN:
            raise _invalid_value(call, f"shared_mem {smem} is outside [0, {_MAX_SHARED_OPTIN}]")
        if not isinstance(args, _SimArgs):
            raise TypeError("launch: args must come from this backend's make_args()")
        self._devs[s.device].touched = True
        self._submit(s, self._kernel_op,
                     (function, g, b, smem, args.values, self._devs[s.device].physical))

    # ------------------------------------------------------------ virtual memory (VMM)
    def vmm_granularity(self, device: int) -> int:
        self._device(device, "cuMemGetAllocationGranularity")
        return _VMM_GRANULARITY

    def vmm_reserve(self, device: int, size: int) -> int:
        """Reserve ``size`` bytes (a multiple of the granularity) of virtual address space,
        backed by a host mapping of its own that the kernel commits only where it is used."""
        call = "cuMemAddressReserve"
        d = self._device(device, call)
        n = self._vmm_size(size, call)
        try:
            mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise _out_of_memory(
                call, f"out of memory (the simulator could not reserve {n} bytes of host "
                      f"address space: {exc})") from None
        with self._mem_update(call):
            start = self._vmm_place(n)
            if start is None:
                mm.close()
                raise _out_of_memory(call, "out of memory (simulated virtual address space "
                                           "exhausted)")
            self._vmm_ranges[start] = _VmmRange(start, n, d, mm)
            bisect.insort(self._vmm_starts, start)
            self._flush_graveyard()
        self._devs[d].touched = True
        return start

    def vmm_free_address(self, ptr: int, size: int) -> None:
        """Return a reservation (``ptr`` and ``size`` exactly as reserved, nothing mapped)."""
        call = "cuMemAddressFree"
        p = self._ptr(ptr, call)
        n = self._size(size, call)
        with self._mem_update(call):
            r = self._vmm_ranges.get(p)
            if r is None or r.size != n:
                raise _invalid_value(call, f"0x{p:x}+{n} is not a reservation from "
                                           "vmm_reserve")
            if r.maps:
                raise _invalid_value(call, f"0x{p:x}+{n} still has {len(r.maps)} mapping(s); "
                                           "unmap them first")
            del self._vmm_ranges[p]
            del self._vmm_starts[bisect.bisect_left(self._vmm_starts, p)]
            # Work held back on a paused stream may still reference the range: keep the
            # host mapping until nothing is queued.
            self._host_graveyard.append(r.mm)
            self._flush_graveyard()

    def vmm_create(self, device: int, size: int) -> Any:
        """Physical memory of ``size`` bytes (a multiple of the granularity), counted against
        the device's capacity; OutOfMemoryError when it does not fit."""
        call = "cuMemCreate"
        d = self._device(device, call)
        n = self._vmm_size(size, call)
        dev = self._devs[d]
        with self._mem_update(call):
            if n > dev.usable - dev.used:
                raise _out_of_memory(call)
            dev.used += n
        dev.touched = True
        return _VmmHandle(self, dev, _next_handle(), n)

    def vmm_release(self, handle: Any) -> None:
        """Release a handle. Like cuMemRelease this is allowed while it is mapped: the memory
        returns to the device when it is unmapped."""
        call = "cuMemRelease"
        h = self._vmm_handle(handle, call)
        with self._mem_update(call):
            if h.released:
                raise _invalid_value(call, f"{h!r} was already released")
            h.released = True
            if not h.mapped:
                self._vmm_free_physical(h)

    def vmm_map(self, device: int, ptr: int, size: int, handle: Any) -> None:
        """Map the first ``size`` bytes of ``handle`` at ``ptr`` (granularity-aligned, inside
        one reservation, not mapped yet) and make them accessible."""
        call = "cuMemMap"
        d = self._device(device, call)
        p = self._ptr(ptr, call)
        n = self._vmm_size(size, call)
        h = self._vmm_handle(handle, call)
        if p % _VMM_GRANULARITY:
            raise _invalid_value(call, f"address 0x{p:x} is not aligned to the granularity "
                                       f"{_VMM_GRANULARITY}")
        if n > h.size:
            raise _invalid_value(call, f"size {n} is larger than the handle's {h.size} bytes")
        with self._mem_update(call):
            if h.released:
                raise _invalid_value(call, f"{h!r} was released")
            if h.mapped:
                raise CudaError(801, "CUDA_ERROR_NOT_SUPPORTED",
                                "operation not supported (the simulator maps a physical "
                                "allocation at one place at a time)", call=call)
            r = self._vmm_range_at(p)
            if r is None or p + n > r.start + r.size:
                raise _invalid_value(call, f"0x{p:x}+{n} is not inside one reservation")
            starts = r.map_starts
            i = bisect.bisect_right(starts, p) - 1
            if (i >= 0 and starts[i] + r.maps[starts[i]][0] > p) or (
                    i + 1 < len(starts) and starts[i + 1] < p + n):
                raise _invalid_value(call, f"0x{p:x}+{n} overlaps a mapped range")
            bisect.insort(starts, p)
            r.maps[p] = (n, h)
            h.mapped = True
        self._devs[d].touched = True

    def vmm_unmap(self, ptr: int, size: int) -> None:
        """Unmap ``[ptr, ptr + size)``: whole mappings only (one or several adjacent ones).

        The range becomes inaccessible and its contents are discarded; handles already
        released return their memory to the device.
        """
        call = "cuMemUnmap"
        p = self._ptr(ptr, call)
        n = self._vmm_size(size, call)
        if self._pending:
            self._pump()
        with self._mem_update(call):
            r = self._vmm_range_at(p)
            covered = []
            cur, stop = p, p + n
            while r is not None and cur < stop:
                m = r.maps.get(cur)
                if m is None:
                    break
                covered.append(cur)
                cur += m[0]
            if r is None or cur != stop:
                raise _invalid_value(call, f"0x{p:x}+{n} is not exactly a set of whole "
                                           "mappings from vmm_map")
            for s in covered:
                _, h = r.maps.pop(s)
                del r.map_starts[bisect.bisect_left(r.map_starts, s)]
                h.mapped = False
                if h.released:
                    self._vmm_free_physical(h)
            try:
                r.mm.madvise(mmap.MADV_DONTNEED, p - r.start, n)
            except (OSError, ValueError, AttributeError):  # pragma: no cover - no madvise
                ctypes.memset(r.addr + (p - r.start), 0, n)

    # ------------------------------------------------------------ stream-ordered pools
    def pool_create(self, device: int) -> Any:
        d = self._device(device, "cuMemPoolCreate")
        dev = self._devs[d]
        dev.touched = True
        return _Pool(self, dev, _next_handle())

    def pool_destroy(self, pool: Any) -> None:
        """Destroy a pool. Like cuMemPoolDestroy, allocations still live (or with a free
        still queued) stay valid: the pool's memory returns to the device when the last one
        is freed; cached memory returns now."""
        call = "cuMemPoolDestroy"
        pl = self._pool(pool, call)
        with self._mem_update(call):
            if pl.destroyed:
                raise _invalid_value(call, f"{pl!r} was already destroyed")
            pl.destroyed = True
            self._pool_drop_idle(pl, 0)

    def pool_alloc_async(self, pool: Any, nbytes: int, stream: Any) -> int:
        """Allocate from the pool's cache, growing it by whole 2 MiB chunks when nothing
        cached fits (OutOfMemoryError when the device cannot hold the chunk)."""
        call = "cuMemAllocFromPoolAsync"
        pl = self._pool(pool, call)
        self._stream(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return 0  # the real driver accepts size 0 too (checked on an H100)
        size = -(-n // _GRANULE) * _GRANULE
        dev = pl.dev
        with self._mem_update(call):
            if pl.destroyed:
                raise _invalid_value(call, f"{pl!r} was destroyed")
            off = pl.take(size)
            if off is None:
                chunk = -(-size // _VMM_GRANULARITY) * _VMM_GRANULARITY
                if chunk > dev.usable - dev.used:
                    raise _out_of_memory(call)
                if dev.mm is None:
                    self._map(dev, call)
                coff = dev.take(chunk)
                if coff is None:
                    raise _out_of_memory(call)
                self._pool_chunks[dev.base + coff] = pl
                pl.add_chunk(coff, chunk)
                off = pl.take(size)
            p = dev.base + off
            self._pool_ptrs[p] = pl
        dev.touched = True
        return p

    def pool_usage(self, pool: Any) -> tuple[int, int, int, int]:
        """(reserved current, reserved high, used current, used high) after letting queued
        runnable work (frees included) run."""
        pl = self._pool(pool, "cuMemPoolGetAttribute")
        if self._pending:
            self._pump()
        with self._mem_lock:
            return pl.reserved, pl.reserved_high, pl.used, pl.used_high

    def pool_reset_high(self, pool: Any) -> None:
        pl = self._pool(pool, "cuMemPoolSetAttribute")
        with self._mem_lock:
            pl.reserved_high = pl.reserved
            pl.used_high = pl.used

    def pool_trim(self, pool: Any, keep: int = 0) -> None:
        """Give chunks with nothing allocated back to the device (most recent first) until
        the pool holds at most ``keep`` bytes or no idle chunk is left."""
        call = "cuMemPoolTrimTo"
        pl = self._pool(pool, call)
        k = self._size(keep, call)
        if self._pending:
            self._pump()
        with self._mem_update(call):
            self._pool_drop_idle(pl, k)

    # ------------------------------------------------------------ NVML
    def nvml(self) -> SimulatedNvml:
        if self._nvml is None:
            self._nvml = SimulatedNvml(self)
        return self._nvml

    # ================================================================ internals
    # -- validation
    def _device(self, device: Any, call: str) -> int:
        try:
            d = operator.index(device)
        except TypeError:
            raise _invalid_device(call, f"{device!r}") from None
        n = len(self._devs)
        if 0 <= d < n:
            return d
        if n == 0:
            raise CudaError(100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected",
                            call="cuDeviceGet")
        raise _invalid_device("cuDeviceGet", f"{d} (device count {n})")

    @staticmethod
    def _size(n: Any, call: str) -> int:
        try:
            v = operator.index(n)
        except TypeError:
            raise _invalid_value(call, f"size must be an int, not {type(n).__name__}") from None
        if v < 0:
            raise _invalid_value(call, f"negative size {v}")
        return v

    @staticmethod
    def _ptr(p: Any, call: str) -> int:
        try:
            return operator.index(p)
        except TypeError:
            raise _invalid_value(call, f"pointer must be an int, not {type(p).__name__}") from None

    @staticmethod
    def _fill_value(value: Any, bits: int, call: str) -> int:
        v = operator.index(value)
        if not -(1 << (bits - 1)) <= v < (1 << bits):
            raise ValueError(f"{call}: fill value {v} does not fit in {bits} bits")
        return v & ((1 << bits) - 1)

    def _stream(self, stream: Any, call: str, allow_destroyed: bool = False) -> _Stream:
        if type(stream) is _Stream and stream.backend is self:
            if stream.destroyed and not (allow_destroyed and stream.queue):
                raise _invalid_handle(call, "the stream was destroyed")
            return stream
        if stream is None or (type(stream) is int and stream == 0):
            d = getattr(self._tls, "device", None)
            if d is None:
                raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context",
                                call=call)
            return self._devs[d].null
        raise _invalid_handle(call, f"{stream!r} is not a stream of this simulator")

    def _event_handle(self, event: Any, call: str) -> _Event:
        if type(event) is _Event and event.backend is self and not event.destroyed:
            return event
        raise _invalid_handle(call, f"{event!r} is not a live event of this simulator")

    def _event(self, event: Any, call: str) -> _Event:
        ev = self._event_handle(event, call)
        return ev.target if ev.target is not None else ev

    def _module(self, module: Any, call: str) -> _Module:
        if type(module) is _Module and module.backend is self and not module.unloaded:
            return module
        raise _invalid_handle(call, f"{module!r} is not a loaded module of this simulator")

    # -- memory internals
    def _owner(self, p: int) -> int | None:
        if FAKE_BASE <= p < _FAKE_END:
            d = (p - FAKE_BASE) // DEVICE_STRIDE
            if d < len(self._devs):
                return d
        elif _VMM_BASE <= p < _VMM_END and self._vmm_ranges:
            hit = self._vmm_translate(p, 1)
            return None if hit is None else hit[1]
        return None

    def _alloc_start(self, p: int) -> tuple[_Device, int] | None:
        d = self._owner(p)
        if d is None:
            return None
        dev = self._devs[d]
        off = p - dev.base
        return (dev, off) if off in dev.alloc_size else None

    def _alloc(self, device: Any, nbytes: Any, call: str) -> int:
        d = self._device(device, call)
        n = self._size(nbytes, call)
        if n == 0:
            return 0  # like torch and the real backend: empty allocations are the null pointer
        size = -(-n // _GRANULE) * _GRANULE
        dev = self._devs[d]
        with self._mem_lock:
            if self._mem_busy:
                raise RuntimeError("simulator: device allocation re-entered from a finalizer "
                                   "during a memory bookkeeping update")
            self._mem_busy = True
            try:
                if size > dev.usable - dev.used:
                    raise _out_of_memory(call)
                if dev.mm is None:
                    self._map(dev, call)
                off = dev.take(size)
                if off is None:
                    raise _out_of_memory(call)
            finally:
                self._mem_busy = False
                if self._deferred_frees:
                    self._run_deferred_frees()
        dev.touched = True
        return dev.base + off

    def _map(self, dev: _Device, call: str) -> None:
        size = -(-dev.capacity // _PAGE) * _PAGE
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise _out_of_memory(
                call, f"out of memory (the simulator could not reserve {size} bytes of host "
                      f"address space for device {dev.ordinal}: {exc}; lower "
                      "CUDALAB_SIMULATOR_MEMORY)") from None
        dev.addr = _address_of(mm)
        dev.mm = mm

    def _free(self, ptr: Any, call: str, from_async: bool = False) -> None:
        p = self._ptr(ptr, call)
        with self._mem_lock:
            if self._mem_busy:
                # Re-entered (a finalizer ran in the middle of an update in this thread).
                self._deferred_frees.append((p, from_async))
                return
            self._mem_busy = True
            try:
                self._free_locked(p, call, from_async)
            finally:
                self._mem_busy = False
                if self._deferred_frees:
                    self._run_deferred_frees()

    def _free_locked(self, p: int, call: str, from_async: bool) -> None:
        pool = self._pool_ptrs.get(p)
        if pool is not None:
            self._pool_free_locked(pool, p, call, from_async)
            return
        loc = self._alloc_start(p)
        if loc is None or p in self._pool_chunks:
            raise CudaError(1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", call=call)
        dev, off = loc
        if from_async:
            dev.async_freeing.discard(off)
        elif off in dev.async_freeing:  # a stream-ordered free is already queued
            raise CudaError(1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", call=call)
        size, start, end = dev.release(off)
        if size >= _MADVISE_MIN and dev.mm is not None:
            lo = max(start, off - _PAGE)
            hi = min(end, off + size + _PAGE)
            lo = -(-lo // _PAGE) * _PAGE
            hi = hi // _PAGE * _PAGE
            if hi > lo:
                try:
                    dev.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                except (OSError, ValueError, AttributeError):
                    pass

    def _run_deferred_frees(self) -> None:
        # Called with the lock held and _mem_busy False.
        while self._deferred_frees:
            p, from_async = self._deferred_frees.pop()
            self._mem_busy = True
            try:
                self._free_locked(p, "cuMemFree", from_async)
            except CudaError as exc:
                warnings.warn(f"simulator: deferred free of 0x{p:x} failed: {exc}",
                              RuntimeWarning, stacklevel=2)
            finally:
                self._mem_busy = False

    def _flush_graveyard(self) -> None:
        if self._host_graveyard and not self._pending:
            dead, self._host_graveyard = self._host_graveyard, []
            for mm in dead:
                try:
                    mm.close()
                except BufferError:  # still exported somewhere: let the GC unmap it
                    pass

    # -- virtual memory and pool internals
    @contextlib.contextmanager
    def _mem_update(self, call: str):
        """Hold the memory lock for a bookkeeping update; frees re-entering from finalizers
        meanwhile are deferred to its end (as in :meth:`_alloc`)."""
        with self._mem_lock:
            if self._mem_busy:
                raise RuntimeError(f"simulator: {call} re-entered from a finalizer during a "
                                   "memory bookkeeping update")
            self._mem_busy = True
            try:
                yield
            finally:
                self._mem_busy = False
                if self._deferred_frees:
                    self._run_deferred_frees()

    @classmethod
    def _vmm_size(cls, size: Any, call: str) -> int:
        n = cls._size(size, call)
        if n == 0 or n % _VMM_GRANULARITY:
            raise _invalid_value(call, f"size {n} is not a positive multiple of the "
                                       f"granularity {_VMM_GRANULARITY}")
        return n

    def _vmm_handle(self, handle: Any, call: str) -> _VmmHandle:
        if type(handle) is _VmmHandle and handle.backend is self and not handle.freed:
            return handle
        raise _invalid_value(call, f"{handle!r} is not a live physical memory handle of this "
                                   "simulator")

    def _vmm_free_physical(self, h: _VmmHandle) -> None:
        # Lock held: the handle is released and unmapped.
        h.freed = True
        h.dev.used -= h.size

    def _vmm_place(self, n: int) -> int | None:
        """First fit for a new reservation, one granule clear of its neighbours."""
        gap = _VMM_GRANULARITY
        cand = _VMM_BASE
        for s in self._vmm_starts:
            if cand + n + gap <= s:
                break
            cand = max(cand, s + self._vmm_ranges[s].size + gap)
        return cand if cand + n <= _VMM_END else None

    def _vmm_range_at(self, p: int) -> _VmmRange | None:
        starts = self._vmm_starts
        i = bisect.bisect_right(starts, p) - 1
        if i < 0:
            return None
        r = self._vmm_ranges[starts[i]]
        return r if p < r.start + r.size else None

    def _vmm_translate(self, p: int, n: int) -> tuple[int, int] | None:
        """(host address, device of the memory) for [p, p + n) when it lies in mapped
        memory (adjacent mappings of one reservation are contiguous), else None."""
        with self._mem_lock:
            r = self._vmm_range_at(p)
            if r is None:
                return None
            starts = r.map_starts
            i = bisect.bisect_right(starts, p) - 1
            if i < 0:
                return None
            size, h = r.maps[starts[i]]
            end = starts[i] + size
            if p >= end:
                return None
            stop = p + n
            while end < stop:
                m = r.maps.get(end)
                if m is None:
                    return None
                end += m[0]
            return r.addr + (p - r.start), h.dev.ordinal

    def _pool(self, pool: Any, call: str) -> _Pool:
        if type(pool) is _Pool and pool.backend is self and not pool.destroyed:
            return pool
        raise _invalid_value(call, f"{pool!r} is not a live memory pool of this simulator")

    def _pool_free_locked(self, pool: _Pool, p: int, call: str, from_async: bool) -> None:
        # Lock held and _mem_busy set (from _free_locked).
        off = p - pool.dev.base
        if from_async:
            pool.freeing.discard(off)
        elif off in pool.freeing:  # a stream-ordered free is already queued
            raise _invalid_value(call)
        del self._pool_ptrs[p]
        pool.give(off)
        if pool.destroyed and not pool.allocs:
            self._pool_drop_idle(pool, 0)

    def _pool_drop_idle(self, pool: _Pool, keep: int) -> None:
        """Give idle chunks back to the device while the pool holds more than ``keep``."""
        dev = pool.dev
        for c in pool.idle_chunks():
            if pool.reserved <= keep:
                break
            pool.drop_chunk(c)
            del self._pool_chunks[dev.base + c]
            size = dev.release(c)[0]
            if dev.mm is not None:  # chunks are 2 MiB aligned: whole pages
                try:
                    dev.mm.madvise(mmap.MADV_DONTNEED, c, size)
                except (OSError, ValueError, AttributeError):
                    pass

    def _addr(self, p: int, n: int, call: str) -> int:
        """Host address of [p, p + n), after checking that the range is usable."""
        if p >= _VMM_BASE:
            hit = self._vmm_translate(p, n) if self._vmm_ranges else None
            if hit is not None:
                return hit[0]
            raise _invalid_value(
                call, f"device range 0x{p:x}+{n} is not inside mapped simulated virtual memory")
        if p >= FAKE_BASE:
            d = self._owner(p)
            if d is not None:
                dev = self._devs[d]
                off = p - dev.base
                with self._mem_lock:
                    if dev.find(off, n):
                        return dev.addr + off
            raise _invalid_value(
                call, f"device range 0x{p:x}+{n} is not inside a live simulated allocation")
        if p < _PAGE or p + n > _USER_LIMIT:
            raise _invalid_value(
                call, f"0x{p:x}+{n} is neither simulated device memory nor a host address")
        starts = self._host_starts
        if starts:
            i = bisect.bisect_right(starts, p) - 1
            if i >= 0:
                entry = self._host.get(starts[i])
                if entry is not None and p < starts[i] + entry[1] < p + n:
                    raise _invalid_value(call, f"0x{p:x}+{n} runs past the end of a pinned "
                                               "host buffer")
        return p

    # -- stream machinery
    def _submit(self, s: _Stream, fn: Callable, args: tuple) -> None:
        """Run ``fn(*args)`` in ``s``'s order: now if the stream is idle, else queued."""
        waits = self._legacy_waits(s) if (self._pending and s.legacy) else None
        with s.lock:
            if waits:
                s.queue.extend(waits)
            if s.queue or s.draining or s.paused:
                s.queue.append((fn, args))
                self._pending.add(s)
                if s.draining or s.paused:
                    return
                fn = None
            s.draining = threading.get_ident()
        seq = self._record_seq
        self._run(s, fn, args)
        if self._pending and self._record_seq != seq:
            self._pump()

    def _run(self, s: _Stream, fn: Callable | None, args: tuple | None) -> None:
        """Run ``fn`` (if any) then ``s``'s runnable queue; the caller set ``s.draining``."""
        q = s.queue
        try:
            if fn is not None:
                fn(*args)
            while True:
                with s.lock:
                    head = q[0] if q and not s.paused else None
                    if head is not None and head.__class__ is _Wait:
                        if head.event.done < head.epoch:
                            head = None
                        else:
                            q.popleft()
                            continue
                    if head is None:
                        s.draining = 0
                        if not q:
                            self._pending.discard(s)
                            if s.destroyed:
                                self._devs[s.device].streams.discard(s)
                        return
                    q.popleft()
                head[0](*head[1])
        except BaseException:
            with s.lock:
                s.draining = 0
                if not q:
                    self._pending.discard(s)
            raise

    def _drain(self, s: _Stream) -> bool:
        with s.lock:
            if s.draining or s.paused:
                return False
            q = s.queue
            if not q:
                self._pending.discard(s)
                return False
            head = q[0]
            if head.__class__ is _Wait and head.event.done < head.epoch:
                return False
            s.draining = threading.get_ident()
        self._run(s, None, None)
        return True

    def _pump(self) -> None:
        """Run every stream's runnable work until nothing more can run."""
        while True:
            progressed = False
            for s in list(self._pending):
                if self._drain(s):
                    progressed = True
            if not progressed:
                return

    def _legacy_waits(self, s: _Stream) -> list[_Wait] | None:
        """Dependencies of new work on ``s`` under legacy default stream semantics."""
        dev = self._devs[s.device]
        if s.is_null:
            others = [t for t in list(dev.streams) if t.legacy and t.queue]
        else:
            others = [dev.null] if dev.null.queue else []
        waits = []
        for t in others:
            marker = _Event(None, t.device, 0, EVENT_DISABLE_TIMING)
            with t.lock:
                if not t.queue:
                    continue
                marker.epoch = 1
                marker.rec_stream = t
                t.queue.append((self._record_op, (marker, 1)))
            waits.append(_Wait(marker, 1, t))
        return waits

    def _stuck_reason(self, s: _Stream, seen: set | None = None) -> str | None:
        """Why ``s`` can never drain (paused, directly or through event waits), or None."""
        if s.paused:
            return (f"{s!r} is paused by the simulator test hook pause_stream(); "
                    "call resume_stream() first")
        if s.draining:
            return None
        try:
            head = s.queue[0]
        except IndexError:
            return None
        if head.__class__ is _Wait and head.event.done < head.epoch and head.stream is not None:
            seen = set() if seen is None else seen
            if s in seen:
                return f"{s!r} is part of a cycle of event waits"
            seen.add(s)
            inner = self._stuck_reason(head.stream, seen)
            if inner:
                return f"{s!r} waits for an event pending on {head.stream!r}, and {inner}"
        return None

    def _sync_stream(self, s: _Stream) -> None:
        delay = 1e-4
        while True:
            if s.queue:
                self._pump()
            with s.lock:
                if not s.queue and not s.draining:
                    return
                if s.draining == threading.get_ident():
                    raise RuntimeError(f"simulator: a kernel running on {s!r} synchronised "
                                       "its own stream")
            reason = self._stuck_reason(s)
            if reason:
                raise RuntimeError(f"simulator: synchronising {s!r} would wait forever: {reason}")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def _sync_op(self, d: int, fn: Callable, args: tuple) -> None:
        """A synchronous operation: ordered on the legacy default stream, then waited for."""
        if not self._pending:
            fn(*args)
            return
        dev = self._devs[d]
        null = dev.null
        # Refuse up front (rather than queue work and then fail the wait) when the legacy
        # default stream could never get to it.
        for t in [null, *[t for t in list(dev.streams) if t.legacy and t.queue]]:
            reason = self._stuck_reason(t)
            if reason:
                raise RuntimeError("simulator: a synchronous copy/fill on the legacy default "
                                   f"stream of device {d} would wait forever: {reason}")
        self._submit(null, fn, args)
        self._sync_stream(null)

    # -- operations (run in stream order)
    def _record_op(self, ev: _Event, epoch: int) -> None:
        if epoch >= ev.done:
            ev.ts = _now()
            ev.done = epoch
        self._record_seq += 1

    def _copy_op(self, dst: int, src: int, n: int, phys: int) -> None:
        t0 = _now()
        ctypes.memmove(dst, src, n)
        self._activity[phys].append((t0, _now(), 1))

    def _memset8_op(self, dst: int, value: int, n: int, phys: int) -> None:
        t0 = _now()
        ctypes.memset(dst, value, n)
        self._activity[phys].append((t0, _now(), 1))

    def _memset32_op(self, dst: int, value: int, count: int, phys: int) -> None:
        t0 = _now()
        total = 4 * count
        ctypes.memmove(dst, value.to_bytes(4, "little"), 4)
        filled = 4
        while filled < total:
            step = min(filled, total - filled)
            ctypes.memmove(dst + filled, dst, step)
            filled += step
        self._activity[phys].append((t0, _now(), 1))

    def _kernel_op(self, fn: _Function, grid, block, smem: int, values: tuple, phys: int) -> None:
        t0 = _now()
        try:
            fn.impl(self, grid, block, smem, *values)
        except CudaError:
            raise
        except Exception as exc:
            raise CudaError(
                719, "CUDA_ERROR_LAUNCH_FAILED",
                f"unspecified launch failure (simulated kernel {fn.name!r} raised "
                f"{type(exc).__name__}: {exc})", call="cuLaunchKernel") from exc
        finally:
            self._activity[phys].append((t0, _now(), 0))

    # -- NVML support
    def _busy(self, phys: int) -> tuple[int, int]:
        """(gpu %, memory %) over the last second for physical device ``phys``."""
        now = _now()
        lo = now - 1_000_000_000
        kern = copy = 0
        any_kern = any_copy = False
        for t0, t1, kind in list(self._activity[phys]):
            if t1 < lo:
                continue
            dt = t1 - max(t0, lo)
            if kind == 0:
                kern += dt
                any_kern = True
            else:
                copy += dt
                any_copy = True

        def pct(ns: float, active: bool) -> int:
            return max(1, min(100, round(ns / 1e7))) if active else 0

        return pct(kern, any_kern), pct(copy + kern / 2, any_kern or any_copy)


def _address_of(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(view)
    del view  # release the buffer export so the mapping can be closed later
    return addr


def _dims(value: Any, limits: tuple[int, int, int], what: str, call: str) -> tuple[int, int, int]:
    try:
        dims = tuple(operator.index(v) for v in value)
    except TypeError:
        raise _invalid_value(call, f"{what} must be three ints, got {value!r}") from None
    if len(dims) != 3:
        raise _invalid_value(call, f"{what} must be three ints, got {value!r}")
    for v, hi in zip(dims, limits):
        if not 1 <= v <= hi:
            raise _invalid_value(call, f"{what} {dims} is outside the limits (1..{limits})")
    return dims  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- NVML
class SimulatedNvml(Nvml):
    """NVML for the simulator: every value is derived from the simulator's own state.

    Sees all simulated devices (it ignores CUDA_VISIBLE_DEVICES, like the real NVML).
    Utilisation is the share of the last second spent in kernels (memory: copies and fills
    plus half the kernel time), at least 1% when anything ran; memory used is exactly the
    simulator's allocations, so it agrees with ``mem_get_info`` (the simulator has no
    context overhead).
    """

    simulated = True

    def __init__(self, backend: SimulatorBackend):
        self._backend = backend

    def __repr__(self) -> str:
        return f"<SimulatedNvml: {self.device_count()} simulated devices (not a real NVML)>"

    def device_count(self) -> int:
        return self._backend._n_total

    def uuids(self) -> list[str]:
        return list(self._backend._uuids)

    def name(self, uuid: str) -> str:
        self._index(uuid)
        return "cudalab simulated GPU (H100-like)"

    def _index(self, uuid: str) -> int:
        text = str(uuid).strip().lower()
        if not text.startswith("gpu-"):
            text = "gpu-" + text
        for i, u in enumerate(self._backend._uuids):
            if u.lower() == text:
                return i
        raise NvmlError(f"NVML (simulated): no simulated device has UUID {uuid!r}")

    def _used(self, phys: int) -> tuple[int, int]:
        b = self._backend
        dev = b._by_physical.get(phys)
        if dev is None:  # hidden from this process by CUDA_VISIBLE_DEVICES
            return b._capacity, 0
        return dev.capacity, dev.used

    def utilization(self, uuid: str) -> tuple[int, int]:
        return self._backend._busy(self._index(uuid))

    def memory_info(self, uuid: str) -> tuple[int, int, int]:
        total, used = self._used(self._index(uuid))
        return total, total - used, used

    def temperature(self, uuid: str) -> int:
        return 35 + self.utilization(uuid)[0] // 4

    def power_usage(self, uuid: str) -> int:
        return 70000 + self.utilization(uuid)[0] * 6000

    def clock_sm(self, uuid: str) -> int:
        return 1980 if self.utilization(uuid)[0] > 0 else 345

    def processes(self, uuid: str) -> list[tuple[int, int | None]]:
        phys = self._index(uuid)
        dev = self._backend._by_physical.get(phys)
        if dev is None or not dev.touched:
            return []
        return [(os.getpid(), self._used(phys)[1])]
