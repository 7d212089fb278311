"""The simulated memory's address layout and bookkeeping structures (no backend logic).

Address layout: device pointers are fake addresses ``FAKE_BASE + ordinal * DEVICE_STRIDE +
offset``, above the 47-bit user address space (they can never alias a real host pointer) and
below ``2**53`` (exact in JSON/JS). Virtual memory reservations (``vmm_reserve``) live above
every device's range, from ``VMM_BASE`` to ``VMM_END``.

Structures, each owned and locked by the backend (``_mem_lock``):

* :class:`SimDevice`: one simulated device's heap, a best-fit sub-allocator with coalescing in
  512-byte granules (2 MiB aligned from 2 MiB up) over one lazily created mapping.
* :class:`SimPool`: a stream-ordered pool's cache of chunks taken from a device heap.
* :class:`SimVmmHandle` and :class:`SimVmmRange`: physical memory handles and address
  reservations of the virtual memory API.

These classes, the layout constants and :func:`address_of` are the simulator package's
internal API (read by its concern modules, never outside ``cudalab._driver``).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys

from cudalab._driver.base import Backend, DeviceInfo
from cudalab._driver.handles import OpaqueHandle
from cudalab._driver.sim.config import MAX_DEVICES, MAX_MEMORY
from cudalab._driver.sim.handles import SimStream

# ------------------------------------------------------------------------------- layout
#: First fake device address (device 0, offset 0).
FAKE_BASE = 0xA000_0000_0000
#: Distance between two devices' fake address ranges: the largest device size
#: (config.MAX_MEMORY, so the two cannot drift).
DEVICE_STRIDE = MAX_MEMORY
FAKE_END = FAKE_BASE + MAX_DEVICES * DEVICE_STRIDE  # < 2**53
#: Virtual memory (vmm_reserve) lives above every device's range, below 2**53.
VMM_BASE = FAKE_END
VMM_END = 1 << 53
VMM_GRANULARITY = 2 << 20
USER_LIMIT = 1 << 47  # end of the x86-64/aarch64 (48-bit VA) user address space
PAGE = mmap.PAGESIZE
#: Allocation granule of device heaps and pools; sizes are rounded up to it.
GRANULE = 512
#: Allocations of at least this size are 2 MiB aligned.
LARGE = 2 << 20
#: Frees of at least this size give their pages back to the OS.
MADVISE_MIN = 64 << 10

MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def address_of(mm: mmap.mmap) -> int:
    """The host address of a mapping's first byte."""
    view = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(view)
    del view  # release the buffer export so the mapping can be closed later
    return addr


class SimDevice:
    """One simulated device: its memory mapping, sub-allocator and streams."""

    #: The device's legacy default stream, set by the backend right after construction
    #: (the stream needs the backend), so it is never None once the device is in use.
    null: SimStream

    def __init__(self, ordinal: int, physical: int, capacity: int):
        self.ordinal = ordinal
        self.physical = physical
        self.capacity = capacity
        self.usable = capacity // GRANULE * GRANULE
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
        self.streams: set[SimStream] = set()
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
        align = LARGE if size >= LARGE else GRANULE
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


class SimVmmHandle(OpaqueHandle):
    """Physical memory from :meth:`SimulatorBackend.vmm_create` (a CUmemGenericAllocationHandle).

    Its capacity returns to the device once it is released and unmapped, in either order.
    """

    __slots__ = ("backend", "dev", "handle", "size", "released", "mapped", "freed")

    def __init__(self, backend: Backend, dev: SimDevice, handle: int, size: int):
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


class SimVmmRange:
    """One reservation from :meth:`SimulatorBackend.vmm_reserve` and its mappings."""

    __slots__ = ("start", "size", "device", "mm", "addr", "maps", "map_starts")

    def __init__(self, start: int, size: int, device: int, mm: mmap.mmap):
        self.start = start
        self.size = size
        self.device = device
        self.mm = mm
        self.addr = address_of(mm)
        self.maps: dict[int, tuple[int, SimVmmHandle]] = {}  # start -> (size, handle)
        self.map_starts: list[int] = []  # sorted


class SimPool(OpaqueHandle):
    """A stream-ordered memory pool (cuMemPoolCreate) with an unlimited release threshold.

    Chunks (multiples of 2 MiB) come from the device's sub-allocator; inside them a best-fit
    allocator (512-byte granules, coalescing within one chunk only, so idle chunks can be
    given back) serves allocations. Offsets are relative to the device's fake base.
    """

    __slots__ = ("backend", "dev", "handle", "destroyed", "chunks", "chunk_offs", "free_size",
                 "free_end", "free_by_size", "allocs", "freeing", "reserved", "reserved_high",
                 "used", "used_high")

    def __init__(self, backend: Backend, dev: SimDevice, handle: int):
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
