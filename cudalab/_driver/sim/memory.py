"""Simulated device and host memory: allocation, copies, fills and address translation.

The :class:`SimMemory` concern of the simulator backend. Each device is one anonymous
private ``mmap`` of its capacity with ``MAP_NORESERVE``, created on the first allocation and
committed lazily by the kernel, so an idle 16 GiB device costs nothing; a best-fit
sub-allocator (:class:`~cudalab._driver.sim.heap.SimDevice`) hands out its fake addresses and
enforces the capacity. Large frees ``madvise(MADV_DONTNEED)`` the pages back to the OS.
Copies translate fake pointers to the mapping and check that device ranges lie inside a live
allocation; any other address is taken as a host address if it is a plausible user-space
address. :meth:`SimMemory.host_view` and :meth:`SimMemory.array` expose memory to kernels and
tests.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import operator
import os
import struct
import warnings
from collections.abc import Iterator
from typing import Any

from cudalab._driver.base import IPC_HANDLE_SIZE
from cudalab._driver.handles import StreamHandle
from cudalab._driver.sim.core import (
    ACTIVITY_COPY,
    SimulatorCore,
    invalid_value,
    now,
    out_of_memory,
)
from cudalab._driver.sim.heap import (
    DEVICE_STRIDE,
    FAKE_BASE,
    FAKE_END,
    GRANULE,
    MADVISE_MIN,
    MAP_ANONYMOUS,
    MAP_NORESERVE,
    PAGE,
    USER_LIMIT,
    VMM_BASE,
    VMM_END,
    SimDevice,
    address_of,
)
from cudalab.errors import CudaError

#: Layout of a simulated IPC memory handle (cuIpcGetMemHandle): magic, version, pid,
#: physical device, allocation offset, size; zero-padded to IPC_HANDLE_SIZE bytes.
_IPC_MEM_MAGIC = b"CLSIMMEM"
_IPC_MEM_VERSION = 1
_IPC_MEM_STRUCT = struct.Struct("<8sIIQQQ")


class SimMemory(SimulatorCore):
    """Device allocations, pinned host memory, copies and fills of the simulator backend."""

    # ------------------------------------------------------------ memory
    def mem_alloc(self, device: int, nbytes: int) -> int:
        return self._alloc(device, nbytes, "cuMemAlloc")

    def mem_free(self, device: int, ptr: int) -> None:
        """Free a device allocation (0 is ignored). Like cuMemFree it first lets queued work
        run, but it does not wait for work held back by :meth:`pause_stream`."""
        self._device(device, "cuMemFree")
        if not ptr:
            return
        if self._captures:
            self._refuse_in_capture("cuMemFree")
        if self._pending:
            self.pump()
        self._free(ptr, "cuMemFree")

    def occupy_as_other_process(self, device: int, nbytes: int, pid: int = 1) -> int:
        """Simulator only: take ``nbytes`` of ``device`` as another process ``pid`` would.

        The memory counts as used (``cuMemGetInfo``, NVML's device figure) and NVML's process
        list shows it under ``pid``, not under this process. Give it back with
        :meth:`mem_free` of the returned address. (For out-of-memory scenarios.)
        """
        ptr = self._alloc(device, nbytes, "occupy_as_other_process")
        if ptr:
            self._foreign[ptr] = (self._device(device, "occupy_as_other_process"), int(pid))
        return ptr

    def other_processes(self, device: int) -> dict[int, int]:
        """Simulator only: the bytes :meth:`occupy_as_other_process` took on ``device``, by
        pid."""
        out: dict[int, int] = {}
        for ptr, (d, pid) in list(self._foreign.items()):
            if d != device:
                continue
            loc = self._alloc_start(ptr)
            if loc is None:  # (freed: _free forgets it)
                continue
            out[pid] = out.get(pid, 0) + loc[0].alloc_size[loc[1]]
        return out

    def mem_alloc_async(self, device: int, nbytes: int, stream: StreamHandle) -> int:
        self._device(device, "cuMemAllocAsync")
        self.stream_of(stream, "cuMemAllocAsync")
        return self._alloc(device, nbytes, "cuMemAllocAsync")

    def mem_free_async(self, device: int, ptr: int, stream: StreamHandle) -> None:
        call = "cuMemFreeAsync"
        self._device(device, call)
        s = self.stream_of(stream, call)
        p = self._ptr(ptr, call)
        if not p:
            return
        with self._mem_lock:
            pool = self._pool_ptrs.get(p)
            if pool is not None:  # a pool allocation: back to its pool in stream order
                off = p - pool.dev.base
                if off in pool.freeing:
                    raise invalid_value(call)
                pool.freeing.add(off)
            else:
                loc = self._alloc_start(p)
                if loc is None or loc[1] in loc[0].async_freeing or p in self._pool_chunks:
                    raise invalid_value(call)
                loc[0].async_freeing.add(loc[1])
        self.submit(s, self._free, (p, call, True))

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
        size = -(-n // PAGE) * PAGE
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise out_of_memory(call, f"out of memory ({exc})") from None
        addr = address_of(mm)
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
            self.pump()
        with self._mem_lock:
            entry = self._host.pop(p, None)
            if entry is None:
                raise invalid_value(call)
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
        hd = self.checked_address(self._ptr(dst, call), n, call)
        hs = self.checked_address(self._ptr(src, call), n, call)
        if self._captures:
            self._refuse_in_capture(call)
        self._sync_op(d, self._copy_op, (hd, hs, n, self._devs[d].physical))

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        call = "cuMemcpyAsync"
        self._device(device, call)
        s = self.stream_of(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        hd = self.checked_address(self._ptr(dst, call), n, call)
        hs = self.checked_address(self._ptr(src, call), n, call)
        if s.capture is not None:
            self._refuse_pageable_copy(s, dst, src, call)
        self.submit(s, self._copy_op, (hd, hs, n, self._devs[s.device].physical))

    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: StreamHandle
    ) -> None:
        call = "cuMemcpyPeerAsync"
        dd = self._device(dst_device, call)
        sd = self._device(src_device, call)
        s = self.stream_of(stream, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        pd, ps = self._ptr(dst, call), self._ptr(src, call)
        if self._owner(pd) != dd:
            raise invalid_value(call, f"destination 0x{pd:x} is not memory of device {dd}")
        if self._owner(ps) != sd:
            raise invalid_value(call, f"source 0x{ps:x} is not memory of device {sd}")
        hd = self.checked_address(pd, n, call)
        hs = self.checked_address(ps, n, call)
        self.submit(s, self._copy_op, (hd, hs, n, self._devs[s.device].physical))

    def memset_d8(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        call = "cuMemsetD8"
        d = self._device(device, call)
        v = self._fill_value(value, 8, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        h = self.checked_address(self._ptr(ptr, call), n, call)
        if self._captures:
            self._refuse_in_capture(call)
        self._sync_op(d, self._memset8_op, (h, v, n, self._devs[d].physical))

    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: StreamHandle) -> None:
        call = "cuMemsetD8Async"
        self._device(device, call)
        s = self.stream_of(stream, call)
        v = self._fill_value(value, 8, call)
        n = self._size(nbytes, call)
        if n == 0:
            return
        h = self.checked_address(self._ptr(ptr, call), n, call)
        self.submit(s, self._memset8_op, (h, v, n, self._devs[s.device].physical))

    def memset_d16_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        self._memset_items_async(device, ptr, value, count, stream, 2, self._memset16_op)

    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        self._memset_items_async(device, ptr, value, count, stream, 4, self._memset32_op)

    def _memset_items_async(self, device: int, ptr: int, value: int, count: int,
                            stream: StreamHandle, itemsize: int, op: Any) -> None:
        """cuMemsetD16Async / cuMemsetD32Async: ``count`` items of ``itemsize`` bytes (2 or
        4) at ``ptr``, which must be aligned to them, queued on ``stream``."""
        call = f"cuMemsetD{8 * itemsize}Async"
        self._device(device, call)
        s = self.stream_of(stream, call)
        v = self._fill_value(value, 8 * itemsize, call)
        n = self._size(count, call)
        p = self._ptr(ptr, call)
        if p % itemsize:
            raise invalid_value(call, f"pointer must be {itemsize}-byte aligned")
        if n == 0:
            return
        h = self.checked_address(p, itemsize * n, call)
        self.submit(s, op, (h, v, n, self._devs[s.device].physical))

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
        if p >= VMM_BASE:  # _owner answers only for mapped virtual memory
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
        addr = self.checked_address(p, n, "host_view")
        return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")

    def array(self, ptr: int, dtype: Any, count: int) -> Any:
        """A writable 1-D numpy view of ``count`` elements of ``dtype`` at ``ptr``."""
        import numpy as np

        dt = np.dtype(dtype)
        c = operator.index(count)
        if c < 0:
            raise ValueError(f"array: count must be >= 0, got {c}")
        if c == 0:
            return np.zeros(0, dtype=dt)
        return np.frombuffer(self.host_view(ptr, c * dt.itemsize), dtype=dt, count=c)

    def ipc_mem_handle(self, ptr: int) -> bytes:
        """A deterministic 64-byte IPC handle of the :meth:`mem_alloc` allocation holding ``ptr``.

        Like cuIpcGetMemHandle (checked on an H100): any address inside a live cuMemAlloc
        allocation gives that allocation's handle, the same bytes every time; pool
        (stream-ordered) memory, virtual memory, host memory, freed memory and 0 raise
        CudaError INVALID_VALUE. (Nothing opens the handle: cudalab does not import device
        memory from other processes.)
        """
        call = "cuIpcGetMemHandle"
        p = self._ptr(ptr, call)
        d = self._owner(p) if p < VMM_BASE else None
        with self._mem_lock:
            start = None
            if d is not None:
                dev = self._devs[d]
                offs = dev.alloc_offs
                i = bisect.bisect_right(offs, p - dev.base) - 1
                if i >= 0 and p - dev.base < offs[i] + dev.alloc_size[offs[i]]:
                    start = offs[i]
            if start is None or dev.base + start in self._pool_chunks:
                raise invalid_value(call, f"0x{p:x} is not inside a live simulated cuMemAlloc "
                                          "allocation")
            size = dev.alloc_size[start]
        raw = _IPC_MEM_STRUCT.pack(_IPC_MEM_MAGIC, _IPC_MEM_VERSION, dev.physical, os.getpid(),
                                   start, size)
        return raw + bytes(IPC_HANDLE_SIZE - len(raw))

    # ================================================================ internals
    def _owner(self, p: int) -> int | None:
        if FAKE_BASE <= p < FAKE_END:
            d = (p - FAKE_BASE) // DEVICE_STRIDE
            if d < len(self._devs):
                return d
        elif VMM_BASE <= p < VMM_END and self._vmm_ranges:
            hit = self._vmm_translate(p, 1)
            return None if hit is None else hit[1]
        return None

    def _alloc_start(self, p: int) -> tuple[SimDevice, int] | None:
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
        size = -(-n // GRANULE) * GRANULE
        dev = self._devs[d]
        with self._mem_lock:
            if self._mem_busy:
                raise RuntimeError("simulator: device allocation re-entered from a finalizer "
                                   "during a memory bookkeeping update")
            self._mem_busy = True
            try:
                if size > dev.usable - dev.used:
                    raise out_of_memory(call)
                if dev.mm is None:
                    self._map(dev, call)
                off = dev.take(size)
                if off is None:
                    raise out_of_memory(call)
            finally:
                self._mem_busy = False
                if self._deferred_frees:
                    self._run_deferred_frees()
        dev.touched = True
        return dev.base + off

    def _map(self, dev: SimDevice, call: str) -> None:
        size = -(-dev.capacity // PAGE) * PAGE
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise out_of_memory(
                call, f"out of memory (the simulator could not reserve {size} bytes of host "
                      f"address space for device {dev.ordinal}: {exc}; lower "
                      "CUDALAB_SIMULATOR_MEMORY)") from None
        dev.addr = address_of(mm)
        dev.mm = mm

    def _free(self, ptr: Any, call: str, from_async: bool = False) -> None:
        p = self._ptr(ptr, call)
        if self._foreign:
            self._foreign.pop(p, None)
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
        if size >= MADVISE_MIN and dev.mm is not None:
            lo = max(start, off - PAGE)
            hi = min(end, off + size + PAGE)
            lo = -(-lo // PAGE) * PAGE
            hi = hi // PAGE * PAGE
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

    @contextlib.contextmanager
    def _mem_update(self, call: str) -> Iterator[None]:
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

    def checked_address(self, p: int, n: int, call: str) -> int:
        """Host address of [p, p + n), after checking that the range is usable."""
        if p >= VMM_BASE:
            hit = self._vmm_translate(p, n) if self._vmm_ranges else None
            if hit is not None:
                return hit[0]
            raise invalid_value(
                call, f"device range 0x{p:x}+{n} is not inside mapped simulated virtual memory")
        if p >= FAKE_BASE:
            d = self._owner(p)
            if d is not None:
                dev = self._devs[d]
                off = p - dev.base
                with self._mem_lock:
                    if dev.find(off, n):
                        return dev.addr + off
            raise invalid_value(
                call, f"device range 0x{p:x}+{n} is not inside a live simulated allocation")
        if p < PAGE or p + n > USER_LIMIT:
            raise invalid_value(
                call, f"0x{p:x}+{n} is neither simulated device memory nor a host address")
        starts = self._host_starts
        if starts:
            i = bisect.bisect_right(starts, p) - 1
            if i >= 0:
                entry = self._host.get(starts[i])
                if entry is not None and p < starts[i] + entry[1] < p + n:
                    raise invalid_value(call, f"0x{p:x}+{n} runs past the end of a pinned "
                                               "host buffer")
        return p

    # -- operations (run in stream order)
    def _copy_op(self, dst: int, src: int, n: int, phys: int) -> None:
        t0 = now()
        ctypes.memmove(dst, src, n)
        self.activity[phys].append((t0, now(), ACTIVITY_COPY))

    def _memset8_op(self, dst: int, value: int, n: int, phys: int) -> None:
        t0 = now()
        ctypes.memset(dst, value, n)
        self.activity[phys].append((t0, now(), ACTIVITY_COPY))

    def _memset16_op(self, dst: int, value: int, count: int, phys: int) -> None:
        self._memset_words(dst, value.to_bytes(2, "little"), count, phys)

    def _memset32_op(self, dst: int, value: int, count: int, phys: int) -> None:
        self._memset_words(dst, value.to_bytes(4, "little"), count, phys)

    def _memset_words(self, dst: int, word: bytes, count: int, phys: int) -> None:
        """``count`` copies of ``word`` at ``dst`` (the filled prefix doubled each step)."""
        t0 = now()
        total = len(word) * count
        ctypes.memmove(dst, word, len(word))
        filled = len(word)
        while filled < total:
            step = min(filled, total - filled)
            ctypes.memmove(dst + filled, dst, step)
            filled += step
        self.activity[phys].append((t0, now(), ACTIVITY_COPY))
