"""Per-allocation access records and the checks: the sanitizer's :class:`Tracker`.

The tracker is what the access sites call while the sanitizer is on: a memory-access
observer of the observer bus (:class:`cudalab._observe.MemoryAccessObserver`). For each allocation it keeps the reads since the last
write and the last writes, each with its byte range, stream and sequence number
(:class:`~cudalab.sanitizer.report.Access`); each new access is checked against the
overlapping previous ones with the vector clocks of
:class:`~cudalab.sanitizer.state.StreamSynchronizations`:

* a read against the writes it overlaps (read after write; a host read when the host reads
  the result);
* a write against the reads it overlaps, or when there are none, against the writes (write
  after read, write after write), as torch's CSAN does;
* a free against every stream other than the allocation's that used the memory and was
  neither ordered before the allocation stream nor named by ``record_stream`` (unsafe
  reuse: the allocator hands the block out again on the allocation stream).

Memory is found by address (the allocation whose range holds it), so views at any offset
and partial overlaps count; an address no allocation holds gets a record of its own
(memory allocated before the sanitizer was on, or not by cudalab). Like CSAN, a free drops
the allocation's history.
"""

from __future__ import annotations

import threading
import warnings
from bisect import bisect_right, insort
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cudalab.memory_tools.stacks import capture_stack, frames_to_dicts
from cudalab.sanitizer.report import (
    HOST_READ,
    RACE,
    READ,
    UNSAFE_REUSE,
    WRITE,
    Access,
    Report,
    StreamRaceError,
    StreamRaceWarning,
    stream_name,
    user_frames,
)
from cudalab.sanitizer.state import StreamKey, StreamSynchronizations, stream_key

__all__ = ["ON_RACE_MODES", "Allocation", "Tracker"]

#: What the tracker does with a finding: raise :class:`StreamRaceError`, warn a
#: :class:`StreamRaceWarning`, or only collect it (``Tracker.reports``).
ON_RACE_MODES = ("raise", "warn", "collect")


class Allocation:
    """What the tracker knows of one allocation.

    Invariants: ``reads`` and ``writes`` hold only accesses inside ``[ptr, ptr + size)``
    (or from ``ptr`` on when the size is unknown); no access in ``reads`` is fully covered
    by a later read of the same stream, none in ``writes`` by a later write.
    """

    __slots__ = ("ptr", "size", "stream", "stack", "reads", "writes", "recorded_streams")

    def __init__(self, ptr: int, size: int, stream: StreamKey | None, stack: tuple | None):
        self.ptr = ptr
        self.size = size  # bytes; for a backfilled record, the size of its first access
        self.stream = stream  # the allocation stream; None: not seen allocated
        self.stack = stack  # raw frames of the allocation; None: not seen allocated
        self.reads: list[Access] = []  # reads since the writes that cover them
        self.writes: list[Access] = []  # the last writes
        self.recorded_streams: set[StreamKey] = set()  # streams given to record_stream

    @property
    def end(self) -> int:
        return self.ptr + max(self.size, 1)


def _overlap(a: Access, start: int, end: int) -> bool:
    return a.start < end and start < a.end


def _fix_race(first: StreamKey, second: StreamKey) -> str:
    return (f"order the second access after the first: queue second.wait_stream(first) "
            f"before it, or record an event on first after the first access and wait for it "
            f"on second (e = first.record_event(); second.wait_event(e)); here first is "
            f"{stream_name(first)} and second is {stream_name(second)}.")


def _fix_host_read(writer: StreamKey, reader: StreamKey) -> str:
    return (f"wait for the writer before the host reads: call writer.synchronize() (or "
            f"synchronize an event recorded after the write), or queue "
            f"reader.wait_stream(writer) before numpy(); here the writer is "
            f"{stream_name(writer)} and the reader (the copy's stream) {stream_name(reader)}.")


def _fix_reuse(user: StreamKey, owner: StreamKey) -> str:
    return (f"call array.record_stream(user) (cudalab.memory.record_stream(ptr, user)) "
            f"before the memory is freed, or queue owner.wait_stream(user) before the free; "
            f"here user is {stream_name(user)} and owner (the allocation stream) "
            f"{stream_name(owner)}.")


class Tracker:
    """The sanitizer's state: allocations, their accesses, the clocks, the findings.

    Parameters
    ----------
    on_race : {"raise", "warn", "collect"}
        What a finding does (see :data:`ON_RACE_MODES`). Findings of frees (which happen in
        finalizers, where nothing can be raised) are raised at the next access or when the
        sanitizer is disabled.
    """

    def __init__(self, on_race: str = "raise"):
        if on_race not in ON_RACE_MODES:
            raise ValueError(f"on_race must be one of {ON_RACE_MODES}, got {on_race!r}")
        self.on_race = on_race
        self.sync = StreamSynchronizations()
        self.allocations: dict[int, Allocation] = {}  # start address -> allocation
        self._starts: list[int] = []  # the keys of allocations, sorted
        self.reports: list[Report] = []  # every finding, in order
        self.pending: list[Report] = []  # findings of frees not yet raised (raise mode)
        self.accesses = 0  # accesses checked (one per memory range per operation)
        self._lock = threading.RLock()  # (re-entrant: a finalizer may free during a check)

    # ------------------------------------------------------------------ allocations
    def _find(self, ptr: int, nbytes: int) -> Allocation:
        """The allocation holding ``ptr`` (a new record of ``nbytes`` if none does)."""
        starts = self._starts
        i = bisect_right(starts, ptr) - 1
        if i >= 0:
            alloc = self.allocations[starts[i]]
            if ptr < alloc.end:
                return alloc
        alloc = Allocation(ptr, nbytes, None, None)
        self.allocations[ptr] = alloc
        insort(starts, ptr)
        return alloc

    def _drop(self, ptr: int) -> Allocation | None:
        alloc = self.allocations.pop(ptr, None)
        if alloc is not None:
            starts = self._starts
            del starts[bisect_right(starts, ptr) - 1]
        return alloc

    def allocated(self, ptr: int, nbytes: int, stream: Any) -> None:
        """Memory ``[ptr, ptr + nbytes)`` was allocated for ``stream`` (its history starts)."""
        if not ptr:
            return
        stack = capture_stack(0)
        with self._lock:
            self._drop(ptr)  # a free not seen (torch backfills the same way)
            alloc = Allocation(ptr, nbytes, stream_key(stream), stack)
            self.allocations[ptr] = alloc
            insort(self._starts, ptr)

    def stream_recorded(self, ptr: int, stream: Any) -> None:
        """``record_stream(ptr, stream)``: the allocator waits for ``stream`` before reuse."""
        with self._lock:
            self._find(ptr, 1).recorded_streams.add(stream_key(stream))

    def freed(self, ptr: int, stream: Any = None) -> None:
        """The free request of the allocation at ``ptr`` (``stream``: its allocation stream,
        when the caller knows it). Never raises: findings wait for the next access."""
        with self._lock:
            alloc = self._drop(ptr)
            if alloc is None:
                return
            owner = alloc.stream if stream is None else stream_key(stream)
            if owner is None:
                return
            latest: dict[StreamKey, Access] = {}
            for access in alloc.reads + alloc.writes:
                other = access.stream
                if other == owner or other in alloc.recorded_streams:
                    continue
                if latest.get(other) is None or latest[other].seq < access.seq:
                    latest[other] = access
            found = []
            for other, access in latest.items():
                if not self.sync.is_ordered_after(owner, access.seq, other):
                    free = Access(WRITE, self.sync.seq, owner,
                                  "free (the allocator may hand the block out again on this stream)",
                                  alloc.ptr, alloc.end, capture_stack(0))
                    found.append(self._report(UNSAFE_REUSE, alloc, free, access,
                                              _fix_reuse(other, owner)))
            if found:
                self.reports.extend(found)
                if self.on_race == "raise":
                    self.pending.extend(found)
                elif self.on_race == "warn":
                    self._warn(found)

    # ------------------------------------------------------------------ accesses
    def access(self, stream: Any, reads: Iterable[tuple[int, int]],
               writes: Iterable[tuple[int, int]], name: str) -> None:
        """Device work on ``stream`` reading and writing ``(ptr, nbytes)`` ranges (nbytes 0:
        to the end of the allocation)."""
        key = stream_key(stream)
        stack = capture_stack(0)
        writes = [w for w in writes if w[0]]
        written = {w[0] for w in writes}
        with self._lock:
            seq = self.sync.access(key)
            found: list[Report] = []
            for ptr, nbytes in reads:
                if ptr and ptr not in written:
                    self._read(self._access(READ, seq, key, name, ptr, nbytes, stack), found, RACE)
            for ptr, nbytes in writes:
                self._write(self._access(WRITE, seq, key, name, ptr, nbytes, stack), found)
            self._deliver(found)

    def kernel_launch(self, kernel: Any, stream: Any, values: Sequence[Any]) -> None:
        """A :class:`cudalab.kernels.Kernel` launch with argument ``values`` (pointers as ints)."""
        self.access(stream, [(values[i], 0) for i in kernel.reads],
                    [(values[i], 0) for i in kernel.writes], f"kernel {kernel.name}")

    def transfer(self, stream: Any, device_ptr: int, nbytes: int, to_host: bool,
                 waited: bool) -> None:
        """A host transfer on ``stream`` of device memory ``[device_ptr, +nbytes)``: to the
        host (a read that the host then sees) or from it (a write); ``waited``: the host
        waited for the copy (a synchronisation of ``stream``)."""
        key = stream_key(stream)
        stack = capture_stack(0)
        with self._lock:
            seq = self.sync.access(key)
            found: list[Report] = []
            if to_host:
                self._read(self._access(READ, seq, key, "copy (device to host)", device_ptr,
                                        nbytes, stack), found, HOST_READ)
            else:
                self._write(self._access(WRITE, seq, key, "copy (host to device)", device_ptr,
                                         nbytes, stack), found)
            if waited:
                self.sync.stream_synchronize(key)
            self._deliver(found)

    def _access(self, type_: str, seq: int, key: StreamKey, name: str, ptr: int, nbytes: int,
                stack: tuple) -> tuple[Allocation, Access]:
        alloc = self._find(ptr, nbytes)
        end = ptr + nbytes if nbytes > 0 else alloc.end
        self.accesses += 1
        return alloc, Access(type_, seq, key, name, ptr, end, stack)

    def _read(self, item: tuple[Allocation, Access], found: list[Report], kind: str) -> None:
        alloc, acc = item
        for w in alloc.writes:
            if (w.stream != acc.stream and _overlap(w, acc.start, acc.end)
                    and not self.sync.is_ordered_after(acc.stream, w.seq, w.stream)):
                fix = (_fix_host_read(w.stream, acc.stream) if kind == HOST_READ
                       else _fix_race(w.stream, acc.stream))
                found.append(self._report(kind, alloc, acc, w, fix))
        alloc.reads = [r for r in alloc.reads
                       if not (r.stream == acc.stream and acc.start <= r.start and r.end <= acc.end)]
        alloc.reads.append(acc)

    def _write(self, item: tuple[Allocation, Access], found: list[Report]) -> None:
        alloc, acc = item
        start, end = acc.start, acc.end
        previous = [r for r in alloc.reads if _overlap(r, start, end)]
        if not previous:
            previous = [w for w in alloc.writes if _overlap(w, start, end)]
        for p in previous:
            if p.stream != acc.stream and not self.sync.is_ordered_after(acc.stream, p.seq, p.stream):
                found.append(self._report(RACE, alloc, acc, p, _fix_race(p.stream, acc.stream)))
        alloc.reads = [r for r in alloc.reads if not (start <= r.start and r.end <= end)]
        alloc.writes = [w for w in alloc.writes if not (start <= w.start and w.end <= end)]
        alloc.writes.append(acc)

    # ------------------------------------------------------------------ happens-before
    def stream_created(self, stream: Any) -> None:
        with self._lock:
            self.sync.create_stream(stream_key(stream))

    def event_record(self, event: Any, stream: Any) -> None:
        with self._lock:
            self.sync.record(id(event), stream_key(stream))

    def event_wait(self, event: Any, stream: Any) -> None:
        with self._lock:
            self.sync.wait(id(event), stream_key(stream))

    def event_synchronize(self, event: Any) -> None:
        with self._lock:
            self.sync.event_synchronize(id(event))

    def stream_synchronize(self, stream: Any) -> None:
        with self._lock:
            self.sync.stream_synchronize(stream_key(stream))

    def device_synchronize(self, device: int) -> None:
        with self._lock:
            self.sync.device_synchronize(device)

    # ------------------------------------------------------------------ findings
    def _report(self, kind: str, alloc: Allocation, current: Access, previous: Access,
                fix: str) -> Report:
        from cudalab import _internal  # (CUDA is initialised: an access was queued)

        cache: dict = {}
        alloc_frames: list[Mapping[str, Any]] | None = (
            None if alloc.stack is None else list(frames_to_dicts(alloc.stack, cache)))
        alloc_user = None if alloc_frames is None else user_frames(alloc_frames)
        return Report(kind, alloc.ptr, alloc.size if alloc.stream is not None else 0,
                      alloc_user, _with_frames(current, cache), _with_frames(previous, cache),
                      fix, _internal.backend().simulated,
                      allocation_folded=(alloc_frames or [])[len(alloc_user or []):])

    def _warn(self, found: list[Report]) -> None:
        for report in found:
            warnings.warn(str(report), StreamRaceWarning, stacklevel=4)

    def _deliver(self, found: list[Report]) -> None:
        """Act on an operation's findings (and raise those of earlier frees)."""
        if found:
            self.reports.extend(found)
            if self.on_race == "warn":
                self._warn(found)
        if self.on_race == "raise" and (found or self.pending):
            self.flush(found)

    def flush(self, found: list[Report] | None = None) -> None:
        """Raise the findings not raised yet (raise mode), if any.

        Raises
        ------
        StreamRaceError
            With the pending findings of frees and ``found``.
        """
        errors = self.pending + (found or [])
        self.pending = []
        if errors and self.on_race == "raise":
            raise StreamRaceError(errors)


def _with_frames(access: Access, cache: dict) -> Access:
    """A copy of ``access`` whose stack is frame dicts (the record keeps raw frames): the
    user's, and the rest folded."""
    frames = frames_to_dicts(access.stack, cache)
    user = user_frames(frames)
    return Access(access.type, access.seq, access.stream, access.operation, access.start,
                  access.end, user, frames[len(user):])
