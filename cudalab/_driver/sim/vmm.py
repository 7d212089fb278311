"""Simulated virtual memory management (VMM) and stream-ordered memory pools.

The :class:`SimVmm` concern of the simulator backend.

* **Virtual memory.** :meth:`SimVmm.vmm_reserve` hands out address ranges from a region of
  its own above every device's range (``VMM_BASE`` to ``2**53``), each range backed by its
  own lazily committed ``MAP_NORESERVE`` mapping so that translation stays linear;
  reservations are separated by at least one unmapped 2 MiB granule, so no access can run
  from one into the next. Physical memory from :meth:`SimVmm.vmm_create` counts against the
  device's capacity (shared with ``mem_alloc`` and pools). Mapped ranges are usable by
  copies, fills, kernels, ``array`` and ``pointer_device`` (also across adjacent mappings);
  unmapped ones are refused like freed memory. Unmapping discards the contents
  (``MADV_DONTNEED``): a handle mapped again reads zeros, where a real GPU would keep its
  data. One handle can be mapped at one place at a time (a second mapping raises
  ``CUDA_ERROR_NOT_SUPPORTED``).
* **Stream-ordered pools.** A pool takes chunks (multiples of 2 MiB) from the device's
  sub-allocator and serves allocations from them best fit (512-byte granules); freed memory
  stays cached in the pool (an unlimited release threshold) until ``pool_trim`` or
  ``pool_destroy``. ``mem_free_async`` returns memory to its pool when the stream reaches the
  free. Usage counts allocations rounded up to 512 bytes.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from typing import Any

from cudalab._driver.handles import MemoryPoolHandle, PhysicalMemoryHandle, StreamHandle
from cudalab._driver.sim.core import SimulatorCore, invalid_value, out_of_memory
from cudalab._driver.sim.handles import next_handle
from cudalab._driver.sim.heap import (
    GRANULE,
    MAP_ANONYMOUS,
    MAP_NORESERVE,
    VMM_BASE,
    VMM_END,
    VMM_GRANULARITY,
    SimPool,
    SimVmmHandle,
    SimVmmRange,
)
from cudalab.errors import CudaError


class SimVmm(SimulatorCore):
    """Virtual memory (reserve, create, map) and stream-ordered pools of the simulator."""

    # ------------------------------------------------------------ virtual memory (VMM)
    def vmm_granularity(self, device: int) -> int:
        self._device(device, "cuMemGetAllocationGranularity")
        return VMM_GRANULARITY

    def vmm_reserve(self, device: int, size: int) -> int:
        """Reserve ``size`` bytes (a multiple of the granularity) of virtual address space,
        backed by a host mapping of its own that the kernel commits only where it is used."""
        call = "cuMemAddressReserve"
        d = self._device(device, call)
        n = self._vmm_size(size, call)
        try:
            mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise out_of_memory(
                call, f"out of memory (the simulator could not reserve {n} bytes of host "
                      f"address space: {exc})") from None
        with self._mem_update(call):
            start = self._vmm_place(n)
            if start is None:
                mm.close()
                raise out_of_memory(call, "out of memory (simulated virtual address space "
                                           "exhausted)")
            self._vmm_ranges[start] = SimVmmRange(start, n, d, mm)
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
                raise invalid_value(call, f"0x{p:x}+{n} is not a reservation from "
                                           "vmm_reserve")
            if r.maps:
                raise invalid_value(call, f"0x{p:x}+{n} still has {len(r.maps)} mapping(s); "
                                           "unmap them first")
            del self._vmm_ranges[p]
            del self._vmm_starts[bisect.bisect_left(self._vmm_starts, p)]
            # Work held back on a paused stream may still reference the range: keep the
            # host mapping until nothing is queued.
            self._host_graveyard.append(r.mm)
            self._flush_graveyard()

    def vmm_create(self, device: int, size: int) -> PhysicalMemoryHandle:
        """Physical memory of ``size`` bytes (a multiple of the granularity), counted against
        the device's capacity; OutOfMemoryError when it does not fit."""
        call = "cuMemCreate"
        d = self._device(device, call)
        n = self._vmm_size(size, call)
        dev = self._devs[d]
        with self._mem_update(call):
            if n > dev.usable - dev.used:
                raise out_of_memory(call)
            dev.used += n
        dev.touched = True
        return PhysicalMemoryHandle(SimVmmHandle(self, dev, next_handle(), n))

    def vmm_release(self, handle: PhysicalMemoryHandle) -> None:
        """Release a handle. Like cuMemRelease this is allowed while it is mapped: the memory
        returns to the device when it is unmapped."""
        call = "cuMemRelease"
        h = self._vmm_handle(handle, call)
        with self._mem_update(call):
            if h.released:
                raise invalid_value(call, f"{h!r} was already released")
            h.released = True
            if not h.mapped:
                self._vmm_free_physical(h)

    def vmm_map(self, device: int, ptr: int, size: int, handle: PhysicalMemoryHandle) -> None:
        """Map the first ``size`` bytes of ``handle`` at ``ptr`` (granularity-aligned, inside
        one reservation, not mapped yet) and make them accessible."""
        call = "cuMemMap"
        d = self._device(device, call)
        p = self._ptr(ptr, call)
        n = self._vmm_size(size, call)
        h = self._vmm_handle(handle, call)
        if p % VMM_GRANULARITY:
            raise invalid_value(call, f"address 0x{p:x} is not aligned to the granularity "
                                       f"{VMM_GRANULARITY}")
        if n > h.size:
            raise invalid_value(call, f"size {n} is larger than the handle's {h.size} bytes")
        with self._mem_update(call):
            if h.released:
                raise invalid_value(call, f"{h!r} was released")
            if h.mapped:
                raise CudaError(801, "CUDA_ERROR_NOT_SUPPORTED",
                                "operation not supported (the simulator maps a physical "
                                "allocation at one place at a time)", call=call)
            r = self._vmm_range_at(p)
            if r is None or p + n > r.start + r.size:
                raise invalid_value(call, f"0x{p:x}+{n} is not inside one reservation")
            starts = r.map_starts
            i = bisect.bisect_right(starts, p) - 1
            if (i >= 0 and starts[i] + r.maps[starts[i]][0] > p) or (
                    i + 1 < len(starts) and starts[i + 1] < p + n):
                raise invalid_value(call, f"0x{p:x}+{n} overlaps a mapped range")
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
            self.pump()
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
                raise invalid_value(call, f"0x{p:x}+{n} is not exactly a set of whole "
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
    def pool_create(self, device: int) -> MemoryPoolHandle:
        d = self._device(device, "cuMemPoolCreate")
        dev = self._devs[d]
        dev.touched = True
        return MemoryPoolHandle(SimPool(self, dev, next_handle()))

    def pool_destroy(self, pool: MemoryPoolHandle) -> None:
        """Destroy a pool. Like cuMemPoolDestroy, allocations still live (or with a free
        still queued) stay valid: the pool's memory returns to the device when the last one
        is freed; cached memory returns now."""
        call = "cuMemPoolDestroy"
        pl = self._pool(pool, call)
        with self._mem_update(call):
            if pl.destroyed:
                raise invalid_value(call, f"{pl!r} was already destroyed")
            pl.destroyed = True
            self._pool_drop_idle(pl, 0)

    def pool_alloc_async(self, pool: MemoryPoolHandle, nbytes: int, stream: StreamHandle) -> int:
        """Allocate from the pool's cache, growing it by whole 2 MiB chunks when nothing
        cached fits (OutOfMemoryError when the device cannot hold the chunk)."""
        call = "cuMemAllocFromPoolAsync"
        pl = self._pool(pool, call)
        self.stream_of(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return 0  # the real driver accepts size 0 too (checked on an H100)
        size = -(-n // GRANULE) * GRANULE
        dev = pl.dev
        with self._mem_update(call):
            if pl.destroyed:
                raise invalid_value(call, f"{pl!r} was destroyed")
            off = pl.take(size)
            if off is None:
                chunk = -(-size // VMM_GRANULARITY) * VMM_GRANULARITY
                if chunk > dev.usable - dev.used:
                    raise out_of_memory(call)
                if dev.mm is None:
                    self._map(dev, call)
                coff = dev.take(chunk)
                if coff is None:
                    raise out_of_memory(call)
                self._pool_chunks[dev.base + coff] = pl
                pl.add_chunk(coff, chunk)
                off = pl.take(size)
                assert off is not None  # the new chunk holds it
            p = dev.base + off
            self._pool_ptrs[p] = pl
        dev.touched = True
        return p

    def pool_usage(self, pool: MemoryPoolHandle) -> tuple[int, int, int, int]:
        """(reserved current, reserved high, used current, used high) after letting queued
        runnable work (frees included) run."""
        pl = self._pool(pool, "cuMemPoolGetAttribute")
        if self._pending:
            self.pump()
        with self._mem_lock:
            return pl.reserved, pl.reserved_high, pl.used, pl.used_high

    def pool_reset_high(self, pool: MemoryPoolHandle) -> None:
        pl = self._pool(pool, "cuMemPoolSetAttribute")
        with self._mem_lock:
            pl.reserved_high = pl.reserved
            pl.used_high = pl.used

    def pool_trim(self, pool: MemoryPoolHandle, keep: int = 0) -> None:
        """Give chunks with nothing allocated back to the device (most recent first) until
        the pool holds at most ``keep`` bytes or no idle chunk is left."""
        call = "cuMemPoolTrimTo"
        pl = self._pool(pool, call)
        k = self._size(keep, call)
        if self._pending:
            self.pump()
        with self._mem_update(call):
            self._pool_drop_idle(pl, k)


    # ================================================================ internals
    @classmethod
    def _vmm_size(cls, size: Any, call: str) -> int:
        n = cls._size(size, call)
        if n == 0 or n % VMM_GRANULARITY:
            raise invalid_value(call, f"size {n} is not a positive multiple of the "
                                       f"granularity {VMM_GRANULARITY}")
        return n

    def _vmm_handle(self, handle: Any, call: str) -> SimVmmHandle:
        if type(handle) is SimVmmHandle and handle.backend is self and not handle.freed:
            return handle
        raise invalid_value(call, f"{handle!r} is not a live physical memory handle of this "
                                   "simulator")

    def _vmm_free_physical(self, h: SimVmmHandle) -> None:
        # Lock held: the handle is released and unmapped.
        h.freed = True
        h.dev.used -= h.size

    def _vmm_place(self, n: int) -> int | None:
        """First fit for a new reservation, one granule clear of its neighbours."""
        gap = VMM_GRANULARITY
        cand = VMM_BASE
        for s in self._vmm_starts:
            if cand + n + gap <= s:
                break
            cand = max(cand, s + self._vmm_ranges[s].size + gap)
        return cand if cand + n <= VMM_END else None

    def _vmm_range_at(self, p: int) -> SimVmmRange | None:
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

    def _pool(self, pool: MemoryPoolHandle, call: str) -> SimPool:
        if type(pool) is SimPool and pool.backend is self and not pool.destroyed:
            return pool
        raise invalid_value(call, f"{pool!r} is not a live memory pool of this simulator")

    def _pool_free_locked(self, pool: SimPool, p: int, call: str, from_async: bool) -> None:
        # Lock held and _mem_busy set (from _free_locked).
        off = p - pool.dev.base
        if from_async:
            pool.freeing.discard(off)
        elif off in pool.freeing:  # a stream-ordered free is already queued
            raise invalid_value(call)
        del self._pool_ptrs[p]
        pool.give(off)
        if pool.destroyed and not pool.allocs:
            self._pool_drop_idle(pool, 0)

    def _pool_drop_idle(self, pool: SimPool, keep: int) -> None:
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
