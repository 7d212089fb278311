"""The stream-ordered memory work behind :class:`cudalab.DeviceArray`.

Where an array's memory comes from and goes back to (the caching allocator), how one stream
waits for another (events, no host sync), and the raw transfers and fills an array queues:
host <-> device copies (asynchronous only with pinned memory from the pinned pool) and fills
(eagerly memset when the pattern allows, else cudalab's fill kernels; always the kernels
while a graph is being captured; :func:`scalar_bytes` makes a fill value's bytes). :mod:`cudalab.array` holds the array type and the creation functions
and calls these.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from typing import Any

import numpy as np

from cudalab import _internal, _interrupts, _observe
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._array_state import ArrayState
from cudalab._dtypes import FLOAT8_NAMES, SUPPORTED_DTYPES
from cudalab._kernels.fill import FILL_KERNELS, VECTOR_FILL_KERNEL
from cudalab.allocator import registry as _registry
from cudalab.errors import StreamCaptureError, name_operation

__all__ = [
    "allocator_of",
    "check_host_operand",
    "converts_on_device",
    "device_copies",
    "device_copy",
    "fill",
    "foreign_waits_for",
    "host_transfer",
    "memory_api",
    "null_context",
    "pinned_pool",
    "release_device_memory",
    "same_stream",
    "scalar_bytes",
    "stream_of",
    "stranded",
    "wait_stream",
    "waits_for_foreign",
]

#: The dtypes a DeviceArray holds, as a set (a host source of one converts on the device).
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
#: The registry's per-device allocators (the list object itself: never replaced).
_allocators = _registry.allocators
#: The captures in progress (``cudalab.streams.open_captures``, the dict itself: never
#: replaced); a fill reads only whether it is empty.
_open_captures = _streams.open_captures

#: The fill kernel's launch shape: 256 threads per block, at most 8192 blocks (grid-stride).
_FILL_BLOCK = 256
_FILL_BLOCK3 = (_FILL_BLOCK, 1, 1)
_FILL_MAX_BLOCKS = 8192
#: The vector fill kernel's block (threads, one 16-byte vector each): 256 (4 KiB a block).
_FILL_VECTOR_BLOCK = 256
#: The most bytes one vector fill covers: 2**31 - 1 blocks (a launch's largest grid.x) of
#: 256 threads, 16 bytes each.
_MAX_VECTOR_BYTES = 0x7FFFFFFF * _FILL_VECTOR_BLOCK * 16


def _vector_shape(warps: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of a vector fill of ``warps`` warps (ceil(vectors / 32)): up to one
    block's worth, one block of whole warps; beyond, ceil(vectors / 256) blocks of 256."""
    per_block = _FILL_VECTOR_BLOCK // 32
    if warps <= per_block:
        return (1, 1, 1), (32 * max(warps, 1), 1, 1)
    return (-(-warps // per_block), 1, 1), (_FILL_VECTOR_BLOCK, 1, 1)


#: _vector_shape of 0 to 128 warps (fills up to 64 KiB), made once.
_VECTOR_SHAPES = [_vector_shape(warps) for warps in range(129)]

#: Whether a fill captured into a graph is launched with programmatic dependent launch on a
#: device of compute capability 9.0+ (each fill kernel then begins while the previous one
#: ends, and waits for it: see cudalab._kernels.fill). Chosen from the rows of
#: benchmarks/graphs.py: on an H200, 1,000 float32 4 KiB fills replay in 456 us with it and
#: 702 us without (torch's fill_: 877 us). ``CUDALAB_PROGRAMMATIC_FILLS=0`` turns it off.
PROGRAMMATIC_FILLS = os.environ.get("CUDALAB_PROGRAMMATIC_FILLS", "1").strip() != "0"
#: Device -> whether it takes programmatic dependent launch (compute capability >= 9.0).
_programmatic_devices: dict[int, bool] = {}

# --------------------------------------------------------------------------- lazy imports
_mem: Any = None  # cudalab.memory, bound on first use (it imports the allocator)
_pinned: Any = None  # cudalab.allocator.pinned, bound on first use


def memory_api() -> Any:
    """The :mod:`cudalab.memory` module (imported on first use: arrays load before it)."""
    global _mem
    if _mem is None:
        from cudalab import memory

        _mem = memory
    return _mem


def pinned_pool() -> Any:
    """The :mod:`cudalab.allocator.pinned` module (imported on first use)."""
    global _pinned
    if _pinned is None:
        from cudalab.allocator import pinned

        _pinned = pinned
    return _pinned


_interrupts.guard(memory_api, pinned_pool)  # lazy imports: Ctrl-C waits until they are done


def allocator_of(device: int) -> Any:
    """The device's allocator (created on first use), without the public API's checks.

    Every :class:`cudalab.DeviceArray` calls this: the registry's list is bound at import
    (it is never replaced, see :data:`cudalab.allocator.registry.allocators`), so the
    common case is one index (benchmark row "cudalab empty+drop", benchmarks/history.py).
    """
    a = _allocators[device] if device < len(_allocators) else None
    return a if a is not None else _registry.get_allocator(device)


def release_device_memory(ptr: int) -> None:
    """Return ``ptr`` to the caching allocator, stream-ordered; for finalizers.

    Used by a :class:`cudalab.DeviceArray` whose allocator was replaced, and by the interop
    allocators of :mod:`cudalab.interop`. Does nothing while the process exits.

    Parameters
    ----------
    ptr
        A device address returned by ``caching_allocator_alloc``.

    Raises
    ------
    Nothing: a failure is reported as a RuntimeWarning.
    """
    if _streams.exiting:  # the process is ending: the driver reclaims everything
        return
    try:
        memory_api().caching_allocator_delete(ptr)
    except Exception as exc:
        try:
            warnings.warn(f"cudalab: returning device memory 0x{ptr:x} to the allocator "
                          f"failed: {exc}", RuntimeWarning, stacklevel=2)
        except Exception:
            pass


_interrupts.guard(release_device_memory)  # a finalizer's: Ctrl-C waits until it returns


def stream_of(device: int) -> _streams.Stream:
    """The current stream of ``device`` (where new work on an array is queued)."""
    return _streams.current_stream(device)


def null_context(stream: _streams.Stream) -> None:
    """Make the stream's device current when ``stream`` is a legacy/per-thread pseudo handle
    (they act on the current context)."""
    if stream.is_legacy_null:
        _internal.ensure_context(stream.device_index)


def same_stream(a: int, b: int) -> bool:
    # 0 (null) and 1 (CU_STREAM_LEGACY) name the same legacy default stream.
    return a == b or (a in (0, 1) and b in (0, 1))


# One event per (thread, device) for the ordering waits of copies: recorded on the producer,
# waited on at once by the waiter. A wait holds the record it saw, so re-recording the event
# later never disturbs an earlier wait; per thread, so no other thread records between the
# two. Reusing it spares a cuEventCreate and cuEventDestroy per cross-device copy (the
# small-size rows of benchmarks/comm.py: scatter, gather and the copy path of broadcast).
_order_events = threading.local()  # .by_device: device -> cudalab.Event


def _order_event(device: int) -> Any:
    by_device = getattr(_order_events, "by_device", None)
    if by_device is None:
        by_device = _order_events.by_device = {}
    event = by_device.get(device)
    if event is None:
        from cudalab.events import Event

        event = by_device[device] = Event()
    return event


def _order_event_handle(device: int) -> Any:
    """The driver handle of this thread's ordering event of ``device`` (created on first use)."""
    event = _order_event(device)
    handle = event.handle
    return handle if handle is not None else event.create_handle(device)


def device_copy(dst_device: int, dst: int, src_device: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` (> 0) of device memory from ``src`` on ``src_device`` to ``dst`` on
    ``dst_device``: the byte copy of :meth:`DeviceArray.copy_` and of :mod:`cudalab.comm`'s
    scatter, gather and broadcast.

    On one device, on its current stream. Between two devices, torch's way: on the source
    device's current stream, after the work queued so far on the destination's current
    stream (which may still be using that memory), and the destination's stream then waits
    for the copy. With peer access (the source reaching the destination's memory, enabled
    here once per pair as torch's ``get_p2p_access``) the eight driver calls are one backend
    call (:meth:`Backend.memcpy_ordered`: the 1 KiB rows of benchmarks/comm.py); while the
    stream sanitizer runs they are made one by one through Event and Stream, so that it sees
    the ordering.
    """
    if src_device == dst_device:
        stream = _streams.current_stream(dst_device)
        null_context(stream)
        stream.backend.memcpy_async(dst_device, dst, src, nbytes, stream.handle)
        # (the sanitizer is told once the copy is queued: a race raises after it, as torch's)
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _observe.access_tracker.access(stream, ((src, nbytes),), ((dst, nbytes),),
                                           "copy (device to device)")
        return
    # (The source's stream copies, as torch's copy_: a copy engine pushing to the peer has
    # less latency than the destination's pulling, about 1.5 µs per small copy on 2 x H200.)
    stream = _streams.current_stream(src_device)
    dst_stream = _streams.current_stream(dst_device)
    b = stream.backend
    peer = _internal.enable_peer_access(src_device, dst_device)
    if peer and not _observe.access_on:
        b.memcpy_ordered(dst, src, nbytes, src_device, stream.handle,
                         _order_event_handle(src_device), dst_device, dst_stream.handle,
                         _order_event_handle(dst_device))
        return
    wait_stream(stream, dst_stream)
    null_context(stream)
    if peer:
        b.memcpy_async(src_device, dst, src, nbytes, stream.handle)
    else:  # the driver stages it through the host
        b.memcpy_peer_async(dst, dst_device, src, src_device, nbytes, stream.handle)
    try:
        if _observe.access_on:  # (told once the copy is queued, as above)
            _observe.access_tracker.access(stream, ((src, nbytes),), ((dst, nbytes),),
                                           "copy (peer)")
    finally:
        wait_stream(dst_stream, stream)  # (also when the sanitizer raises: the copy is queued)


#: device_copies lets copies run at once only when they move at least this many bytes in
#: all. Below it, each copy is one device_copy in turn (torch's order): the host's time per
#: call, not the copies, sets the pace there, and the overlap needs more driver calls
#: (a gather of 2 x 4 MiB on 2 x H200 is host-bound at 30-40 µs per call; from 2 x 16 MiB
#: the copies take longer than the host).
OVERLAP_MIN_BYTES = 16 << 20

# device -> the side stream of device_copies (non-blocking, so the legacy default stream
# does not serialize with it; made on first use, shared by threads: its work is ordered by
# events alone, so sharing it costs at most some waiting).
_side_streams: dict[int, _streams.Stream] = {}


def _side_stream(device: int) -> _streams.Stream:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams.setdefault(device, _streams.Stream(device=device))
    return stream


def device_copies(dst_device: int, copies: list[tuple[int, int, int, int]]) -> None:
    """Copy runs of bytes from several devices into disjoint ranges of ``dst_device``'s
    memory: ``(dst, src_device, src, nbytes)`` each (what a gather does).

    Each copy is ordered as :func:`device_copy` orders it: after the work queued so far on
    the destination's current stream, which waits for every copy before its later work. But
    the copies do not wait for one another, as a series of ``copy_`` would make them: the
    copies from other devices with peer access are issued first (each on its source's
    current stream, after one wait for the destination's stream), then the destination's
    own copies on its stream, then the destination's stream waits for the others once per
    source device. A gather's local copy then runs beside the copy from its peer, not after
    it (the gather rows of benchmarks/comm.py: 64 MiB in 192 µs, not 230, on 2 x H200).
    Between two legacy default streams the driver would still run a peer copy and the
    destination's copies one after the other, so there the destination's copies go to a
    side stream of its device (non-blocking: the legacy stream does not wait for it) that
    starts where the peers' copies start. Below :data:`OVERLAP_MIN_BYTES` in all, with the
    stream sanitizer on, or without peer access, each copy is one :func:`device_copy`.

    Ctrl-C waits until the destination's stream waits for every copy issued (a result freed
    before that could be reused while a copy still writes into it), and so does an error.
    """
    if _observe.access_on or sum(c[3] for c in copies) < OVERLAP_MIN_BYTES:
        # (the sanitizer sees each copy's ordering in device_copy)
        for dst, src_device, src, nbytes in copies:
            if nbytes:
                device_copy(dst_device, dst, src_device, src, nbytes)
        return
    dst_stream = _streams.current_stream(dst_device)
    b = dst_stream.backend
    dst_event = _order_event_handle(dst_device)
    pending: dict[int, _streams.Stream] = {}  # source device -> its stream, once it copied
    local = []
    side = None  # the side stream, once it waits for dst_stream (then dst_stream waits for it)
    try:
        for copy in copies:
            dst, src_device, src, nbytes = copy
            if not nbytes:
                continue
            if src_device == dst_device:
                local.append(copy)
            elif _internal.enable_peer_access(src_device, dst_device):
                stream = _streams.current_stream(src_device)
                b.memcpy_ordered(dst, src, nbytes, src_device, stream.handle,
                                 _order_event_handle(src_device), dst_device,
                                 dst_stream.handle, dst_event, join=False)
                pending[src_device] = stream
            else:  # staged through the host: ordered both ways at once
                device_copy(dst_device, dst, src_device, src, nbytes)
        stream = dst_stream
        if local and dst_stream.is_legacy_null and any(s.is_legacy_null for s in pending.values()):
            # (dst_event was last recorded on dst_stream before any copy: the side stream
            # starts where the peers' copies start)
            stream = _side_stream(dst_device)
            b.stream_wait_event(stream.handle, dst_event)
            side = stream
        for dst, _device, src, nbytes in local:
            null_context(stream)
            b.memcpy_async(dst_device, dst, src, nbytes, stream.handle)
    finally:
        if side is not None:
            b.event_record(dst_event, side.handle)
            dst_stream.wait_event(_order_event(dst_device))
        # Each source's event was last recorded after its last copy, on the one stream that
        # made them all, so one wait per source device covers every copy from it.
        for src_device in pending:
            dst_stream.wait_event(_order_event(src_device))


_interrupts.guard(device_copies)


def wait_stream(waiter: _streams.Stream, producer: _streams.Stream) -> None:
    """Make ``waiter`` wait for the work queued so far on ``producer`` (no host sync)."""
    if (waiter.device_index == producer.device_index
            and same_stream(waiter.cuda_stream, producer.cuda_stream)):
        return
    # (Event.record and Stream.wait_event make the right context current themselves where a
    # legacy/per-thread pseudo handle needs it.)
    ev = _order_event(producer.device_index)
    ev.record(producer)
    waiter.wait_event(ev)


def foreign_waits_for(value: int, ours: _streams.Stream) -> None:
    """Another library's stream ``value`` waits for ``ours`` (a DLPack export)."""
    if not same_stream(value, ours.cuda_stream):
        wait_stream(_streams.ExternalStream(value, ours.device_index), ours)


def waits_for_foreign(ours: _streams.Stream, value: int) -> None:
    """``ours`` waits for another library's stream ``value`` (a CAI import)."""
    if not same_stream(value, ours.cuda_stream):
        wait_stream(ours, _streams.ExternalStream(value, ours.device_index))


# --------------------------------------------------------------------------- transfers and fills
def check_host_operand(arr: np.ndarray, dev: ArrayState, what: str, writable: bool) -> None:
    """Raise ValueError unless host ``arr`` matches ``dev`` exactly and is C-contiguous."""
    if arr.shape != dev.shape or arr.dtype != dev.dtype:
        raise ValueError(
            f"{what}: the host array has shape {arr.shape} and dtype {arr.dtype}, the "
            f"DeviceArray has shape {dev.shape} and dtype {dev.dtype}; they must match "
            "exactly (no broadcasting or casting)")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the host array is not C-contiguous (strides {arr.strides}); "
                         "pass np.ascontiguousarray(a) instead")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: the host array is read-only")


#: Host buffers of copies that were queued but whose wait failed (the stream raised, or
#: Ctrl-C), as (stream, buffer): each buffer is kept alive until its stream has run all its
#: work, so the copy never touches freed memory. Pruned when another one is added.
stranded: list[tuple[_streams.Stream, Any]] = []


def _strand(stream: _streams.Stream, buffer: Any) -> None:
    """Keep ``buffer`` alive until ``stream`` is idle (a copy touching it may still be
    queued there), dropping the buffers of streams already idle."""
    still = []
    for entry in stranded:
        try:
            idle = entry[0].backend.stream_query(entry[0].handle)
        except Exception:  # a closed or broken stream: keep the buffer (a leak, not a crash)
            idle = False
        if not idle:
            still.append(entry)
    still.append((stream, buffer))
    stranded[:] = still


def converts_on_device(src: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a copy of host ``src`` into an array of ``shape`` (and another dtype or shape)
    uploads ``src`` as it is and converts it to ``dtype`` on the device, in stream order: a
    C-contiguous source of a supported dtype that numpy broadcasts to ``shape``, and a
    ``dtype`` with conversion kernels (else it is converted on the host, which also says why
    a shape does not fit)."""
    if not src.flags.c_contiguous or src.dtype not in _SUPPORTED or dtype.name in FLOAT8_NAMES:
        return False  # (float8 has no conversion kernel: numpy's on the host)
    try:
        return np.broadcast_shapes(src.shape, shape) == shape
    except ValueError:
        return False


def wait_for_pinned_source(src: np.ndarray, device: int) -> None:
    """Before a host source is converted on the host (by numpy, at once): when it lies in
    pinned memory, wait for ``device``'s current stream, so the read sees what an earlier
    queued copy writes there (a device-to-pinned copy with ``non_blocking=True``), as a
    conversion on the device, in stream order, would (issue 36, item 1)."""
    if pinned_pool().is_pinned(src):
        stream_of(device).synchronize()


def host_transfer(device: int, dst: int, src: int, n: int, stream: _streams.Stream, host: int,
                   non_blocking: bool, what: str, buffer: Any = None) -> None:
    """Copy ``n`` bytes between the device and host address ``host`` (``dst`` or ``src``) on
    ``stream``. Waits for it, unless ``non_blocking`` and ``host`` is pinned memory from the
    pinned pool, which then records the use so the buffer is not reused too early.

    ``buffer`` is the object owning the host memory: when the wait fails (raises, or is
    interrupted) with the copy queued, it is kept alive until the stream is idle, so the copy
    cannot write into (or read) memory freed meanwhile."""
    pinned = non_blocking and pinned_pool()._lookup(host, n)
    if not pinned:
        if _observe.sync_on:  # before queuing: in "error" mode nothing is left in flight
            _observe.notify_sync(what)
    null_context(stream)
    try:
        stream.backend.memcpy_async(device, dst, src, n, stream.handle)
        if pinned:
            pinned_pool().record_use(host, stream)
        else:
            try:
                stream.backend.stream_synchronize(stream.handle)
            except BaseException:
                _strand(stream, buffer)
                raise
    except StreamCaptureError as exc:
        raise name_operation(exc, f"{what} (a copy to pageable host memory)") from exc
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        to_host = host == dst
        _observe.access_tracker.transfer(stream, src if to_host else dst, n, to_host, not pinned)


#: Integer dtypes and float32/float64 -> a struct packer of one item: scalar_bytes converts a
#: Python int or float without numpy for these (the "fills eager" and "capture, host time per
#: launch" rows of benchmarks/graphs.py). Native byte order ("="), as numpy's tobytes(), so
#: the two paths cannot drift (tests/runtime/test_array.py compares them); an integer packer
#: raises struct.error out of range, and numpy's path then raises the error.
_INT_PACK = {np.dtype(t): struct.Struct("=" + code).pack
             for t, code in ((np.int8, "b"), (np.uint8, "B"), (np.int16, "h"), (np.uint16, "H"),
                             (np.int32, "i"), (np.uint32, "I"), (np.int64, "q"),
                             (np.uint64, "Q"))}
_FLOAT_PACK = {np.dtype(np.float32): struct.Struct("=f").pack,
               np.dtype(np.float64): struct.Struct("=d").pack}
_EXACT_INT_FLOAT = 2**53  # ints up to this convert to float64 exactly, then round once


def scalar_bytes(value: Any, dtype: np.dtype) -> bytes:
    """One element of ``dtype`` holding ``value``, converted as numpy converts it.

    Raises
    ------
    ValueError
        A value that numpy cannot store as ``dtype`` (out of range, not a number) or that is
        not a scalar.
    """
    kind = type(value)
    if kind is int:
        pack = _INT_PACK.get(dtype)
        if pack is not None:
            try:
                return pack(value)
            except struct.error:  # out of range: numpy's error, below
                pass
        elif -_EXACT_INT_FLOAT <= value <= _EXACT_INT_FLOAT:
            pack = _FLOAT_PACK.get(dtype)
            if pack is not None:
                return pack(value)
    elif kind is float:
        pack = _FLOAT_PACK.get(dtype)
        if pack is not None:
            try:
                return pack(value)
            except OverflowError:  # beyond float32: numpy's inf, below
                pass
    try:
        pattern = np.array(value, dtype=dtype).tobytes()
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"fill_: {value!r} cannot be stored as {dtype}: {exc}") from None
    if len(pattern) != dtype.itemsize:
        raise ValueError(f"fill_: expected a scalar, got {value!r}")
    return pattern


def fill(ptr: int, pattern: bytes, count: int, device: int, stream: _streams.Stream) -> None:
    """Write ``count`` copies of the item ``pattern`` at ``ptr`` on ``stream``.

    The path per case (the "fill_ by dtype" rows of benchmarks/graphs.py, beside torch's):
    while a graph captures, always a kernel (a kernel node replays for a fraction of a memset
    node's host cost; torch's fill_ is a kernel too), the 16-byte vector kernel where the
    range is 16-byte aligned; eagerly a byte-uniform pattern is ``cuMemsetD8Async``, a 4-byte
    one (and a 2-byte one doubled, where the range is 4-byte aligned) ``cuMemsetD32Async``, a
    2-byte one elsewhere ``cuMemsetD16Async``: one driver call, cheaper on the host than a
    kernel launch; 8-byte patterns take the kernel (a memset has no 8-byte form).
    """
    itemsize = len(pattern)
    if _open_captures and itemsize <= 8:  # (one global read while no graph captures)
        # Some stream is capturing a graph: a kernel node, legal on any stream.
        fill_with_kernel(ptr, pattern, count, stream,  # (it makes the context current)
                         PROGRAMMATIC_FILLS and programmatic_launch(device))
    elif not (byte_uniform := pattern.count(pattern[0]) == itemsize) and itemsize == 8:
        fill_with_kernel(ptr, pattern, count, stream)  # (first: the fewest steps to a kernel)
    else:
        b = stream.backend
        h = stream.handle
        nbytes = count * itemsize
        if byte_uniform:
            null_context(stream)
            b.memset_d8_async(device, ptr, pattern[0], nbytes, h)
        elif itemsize == 4 and not ptr & 3:
            null_context(stream)
            b.memset_d32_async(device, ptr, int.from_bytes(pattern, "little"), count, h)
        elif itemsize == 2 and not (ptr | nbytes) & 3:
            null_context(stream)
            b.memset_d32_async(device, ptr, int.from_bytes(pattern * 2, "little"), nbytes >> 2, h)
        elif itemsize == 2 and not ptr & 1:
            null_context(stream)
            b.memset_d16_async(device, ptr, int.from_bytes(pattern, "little"), count, h)
        elif itemsize == 16:
            if pattern[:8] == pattern[8:]:
                fill_with_kernel(ptr, pattern[:8], 2 * count, stream)
            else:
                # Two different 8-byte halves (complex128 with re != im): write one element,
                # then double the filled prefix with device-to-device copies (log2(count) copies).
                fill_with_kernel(ptr, pattern[:8], 1, stream)
                fill_with_kernel(ptr + 8, pattern[8:], 1, stream)
                done = 1
                while done < count:
                    step = min(done, count - done)
                    b.memcpy_async(device, ptr + done * 16, ptr, step * 16, h)
                    done += step
        else:
            fill_with_kernel(ptr, pattern, count, stream)
    # The stream sanitizer (one flag read while it is off) is told once the fill is queued:
    # in raise mode a race raises after the fill, as torch's CSAN (which runs the operation).
    if _observe.access_on:
        _observe.access_tracker.access(stream, (), ((ptr, count * itemsize),), "fill")


def programmatic_launch(device: int) -> bool:
    """Whether ``device`` takes programmatic dependent launch (compute capability 9.0+)."""
    ok = _programmatic_devices.get(device)
    if ok is None:
        ok = _programmatic_devices[device] = _devices.get_device_properties(device).major >= 9
    return ok


def fill_with_kernel(ptr: int, pattern: bytes, count: int, stream: _streams.Stream,
                     programmatic: bool = False) -> None:
    """Fill with cudalab's fill kernels: ``count`` >= 1 items of ``len(pattern)`` bytes (1,
    2, 4 or 8).

    A range that is 16-byte aligned (address and size) takes the 16-byte vector kernel with
    the pattern widened to 8 bytes, one thread per vector, one block up to 4 KiB
    (``cudalab_fill_v16``); an 8-byte aligned one the 8-byte grid-stride kernel with the
    pattern widened; anything else the kernel of the item's own size. Launched with
    ``Kernel.launch_prepared``: the values are built here, in range (the item's own bytes
    for a u4/u8 parameter), and :func:`fill` has told the sanitizer (the "fills eager",
    "capture, host time per launch" and "fill_ by dtype" rows of benchmarks/graphs.py).
    ``programmatic``: launch with programmatic dependent launch (see ``PROGRAMMATIC_FILLS``).
    """
    itemsize = len(pattern)
    nbytes = count * itemsize
    if not ptr & 15 and not nbytes & 15 and nbytes <= _MAX_VECTOR_BYTES:  # (two small ints)
        vectors = nbytes >> 4
        if itemsize < 8:
            pattern = pattern * (8 // itemsize)
        warps = (vectors + 31) >> 5
        try:
            grid3, block3 = _VECTOR_SHAPES[warps]
        except IndexError:  # (beyond 64 KiB)
            grid3, block3 = _vector_shape(warps)
        VECTOR_FILL_KERNEL.launch_prepared(
            grid3, block3, (ptr, int.from_bytes(pattern, "little"), vectors), stream,
            programmatic)
        return
    if itemsize < 8 and not (ptr | nbytes) & 7:  # 8 bytes stored a thread
        pattern, count = pattern * (8 // itemsize), nbytes >> 3
    grid = min(-(-count // _FILL_BLOCK), _FILL_MAX_BLOCKS)
    FILL_KERNELS[len(pattern)].launch_prepared(
        (grid, 1, 1), _FILL_BLOCK3, (ptr, int.from_bytes(pattern, "little"), count), stream,
        programmatic)
