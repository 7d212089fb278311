"""One expandable segment: a reserved range of virtual addresses and the physical pages
mapped into it (torch's ``ExpandableSegment``), over the VMM calls of the driver seam
(``vmm_reserve`` / ``vmm_create`` / ``vmm_map`` / ``vmm_unmap`` / ``vmm_release`` /
``vmm_free_address``: cuMemAddressReserve, cuMemCreate, cuMemMap + cuMemSetAccess, ...).

The allocator that grows blocks into it is :mod:`cudalab.allocator.expandable`; the methods
here are the driver work, called without the allocator's lock.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cudalab import streams as _streams
from cudalab.errors import CudaError, OutOfMemoryError

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = ["ExpandableSegment", "address_space_size"]


def address_space_size(total: int, page: int) -> int:
    """torch's reservation: enough pages for 1.125 × the device's total memory."""
    want = total + total // 8
    return (want + page - 1) // page * page


class ExpandableSegment:
    """One reserved address range of one (stream, pool) and the pages mapped into it.

    ``handles[i]`` is the physical memory mapped at page ``i`` (None where nothing is
    mapped). The driver methods here are called without the allocator's lock.
    """

    __slots__ = ("backend", "device", "stream", "_stream_ref", "is_small", "page", "ptr", "size",
                 "handles", "__weakref__")

    def __init__(self, backend: Backend, device: int, stream: int, stream_obj: Any, is_small: bool,
                 page: int, ptr: int, size: int):
        self.backend = backend
        self.device = device
        #: The allocation stream's key (its handle value).
        self.stream = stream
        self._stream_ref: Callable[[], Any] | None = None
        if stream_obj is not None:
            try:
                self._stream_ref = weakref.ref(stream_obj)
            except TypeError:
                self._stream_ref = lambda obj=stream_obj: obj
        self.is_small = is_small
        self.page = page
        self.ptr = ptr
        self.size = size
        self.handles: list[Any] = [None] * (size // page)

    def __repr__(self) -> str:
        mapped = sum(h is not None for h in self.handles)
        return (f"<ExpandableSegment {self.ptr:#x} {'small' if self.is_small else 'large'} "
                f"stream={self.stream:#x} {mapped}/{len(self.handles)} pages of {self.page}>")

    @property
    def end(self) -> int:
        return self.ptr + self.size

    def pages_inside(self, ptr: int, size: int) -> tuple[int, int]:
        """The pages lying wholly inside [ptr, ptr + size): (first, stop)."""
        page = self.page
        return -(-(ptr - self.ptr) // page), (ptr + size - self.ptr) // page

    def map(self, first: int, stop: int) -> bool:
        """Create and map pages [first, stop). False (nothing left mapped) when the device
        is out of memory; other driver errors are raised after undoing this call's work."""
        backend, dev, page = self.backend, self.device, self.page
        created: list[Any] = []
        try:
            for _ in range(first, stop):
                created.append(backend.vmm_create(dev, page))
        except OutOfMemoryError:
            self._release_handles(created)
            return False
        except BaseException:
            self._release_handles(created)
            raise
        mapped = 0
        try:
            for i, h in enumerate(created):
                backend.vmm_map(dev, self.ptr + (first + i) * page, page, h)
                mapped += 1
        except BaseException:
            for i in range(mapped):
                try:
                    backend.vmm_unmap(self.ptr + (first + i) * page, page)
                except CudaError:
                    pass
            self._release_handles(created)
            raise
        self.handles[first:stop] = created
        return True

    def synchronize(self) -> None:
        """Wait for the work queued on the segment's stream (torch's cudaStreamSynchronize
        before cuMemUnmap); the whole device when the stream object is gone or unknown."""
        backend, dev = self.backend, self.device
        obj = self._stream_ref() if self._stream_ref is not None else None
        handle = obj.handle if isinstance(obj, _streams.Stream) and not obj.closed else None
        try:
            if handle is not None:
                backend.set_context(dev)
                backend.stream_synchronize(handle)
                return
            if self.stream == 0:
                backend.set_context(dev)
                backend.stream_synchronize(backend.null_stream(dev))
                return
        except CudaError:
            pass
        backend.synchronize(dev)

    def unmap(self, first: int, stop: int) -> tuple[int, BaseException | None]:
        """Unmap and release pages [first, stop) (the caller synchronised first). Returns
        how many pages from ``first`` on were unmapped, and the error that stopped it."""
        backend, page = self.backend, self.page
        backend.set_context(self.device)
        done = 0
        for i in range(first, stop):
            try:
                backend.vmm_unmap(self.ptr + i * page, page)
            except CudaError as exc:
                return done, exc
            h = self.handles[i]
            self.handles[i] = None
            done += 1
            try:
                backend.vmm_release(h)
            except CudaError as exc:  # unmapped already: account for it, report the error
                return done, exc
        return done, None

    def release(self) -> None:
        """Give the address range back (nothing may be mapped)."""
        self.backend.set_context(self.device)
        self.backend.vmm_free_address(self.ptr, self.size)

    def _release_handles(self, handles: list[Any]) -> None:
        for h in handles:
            try:
                self.backend.vmm_release(h)
            except CudaError:
                pass
