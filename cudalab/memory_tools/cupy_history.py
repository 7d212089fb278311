"""CuPy's pool allocations as a history, recorded with CuPy's own memory hooks.

CuPy's ``MemoryPool`` keeps no trace and no per-block state a tool can read, but it calls the
*memory hooks* entered on the calling thread (``cupy.cuda.MemoryHook`` objects, each entered
as a context manager): ``malloc_postprocess(device_id, size, mem_size, mem_ptr, pmem_id)``
after a block is taken from the pool, ``free_postprocess(device_id, mem_size, mem_ptr,
pmem_id)`` after one is given back, and ``alloc_postprocess(device_id, mem_size, mem_ptr)``
after the pool took a new segment from the driver (``cudaMalloc``). :func:`record_cupy_history`
enters such a hook and writes each call as a trace entry in cudalab's format (the tuples of
:data:`cudalab.memory_tools.history.FIELDS`, which ``history_frame``, the exports and what-if
read), into one ring of ``max_entries`` per device (the
:class:`~cudalab.memory_tools.history_ring.HistoryRing` of cudalab's own history), with the
stacks cudalab's history captures (``context`` and ``stacks`` as in
:func:`cudalab.memory.record_history`). A block's size is CuPy's rounded ``mem_size`` (what
``used_bytes()`` counts); its ``requested_size`` in snapshots is the ``size`` asked for.

:meth:`CupyRecording.snapshot` is a snapshot in torch's schema (what the snapshot viewer,
``history_frame``, the exports, what-if and memory_viz read) with the ``identity`` key
(allocator ``"cupy"``): the segments and live blocks the recording saw, its trace, and under
``snapshot["cudalab"]`` a note and the pool's own totals (``MemoryPool.used_bytes()`` /
``total_bytes()``) beside the recorded ones.

What CuPy's hook API lets a recording see (the note of each snapshot says it too):

* **one thread**: CuPy keeps the hooks per thread, so the thread that starts the recording
  (a notebook's main thread) is the one recorded; a block freed in another thread (a data
  loader's, or the garbage collector running there) stays live in the recording until the
  pool hands its address out again, when its free is written (and counted in the note);
* **only a pool's allocations**: ``cupy.cuda.set_allocator`` with a plain function (RMM,
  ``malloc_managed``) calls no hook; when cudalab's allocator backs CuPy
  (:mod:`cudalab.interop`), CuPy's arrays are cudalab's allocations and cudalab's own
  history records them, so a CuPy recording is refused and says so;
* **no hook when segments go back to the driver** (``free_all_blocks()``, and the retry
  after a failed ``cudaMalloc``): the recording compares the pool's ``total_bytes()`` with
  the segments it knows, at each new segment and at each snapshot, and when the pool holds
  less it writes a ``segment_free`` for each known segment that holds no live block (the
  segments ``free_all_blocks()`` releases);
* **only what was allocated since the recording started**: a free of an older block is
  counted (the snapshot's note says how many), not written, so the trace stays one the
  replay reads alone; a block the pool cut from an older segment is shown in a segment of
  its own size, marked ``"segment_seen": False``.
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from cudalab import _interrupts, nvtx
from cudalab._units import format_bytes
from cudalab.identity import Identity
from cudalab.memory_tools import stacks as _stacks
from cudalab.memory_tools.history import current_cell, entry_to_dict
from cudalab.memory_tools.history_ring import CHUNK, HistoryRing, TraceEntry
from cudalab.memory_tools.libraries import (
    CUPY_BACKED_BY_CUDALAB,
    SourceUnavailableError,
    cupy_backing,
    cupy_pool_figures,
)
from cudalab.memory_tools.stacks import FrameCache, Stack

__all__ = ["HOOK_NAME", "CupyRecording", "current_recording", "record_cupy_history"]

#: The name of the recording's hook among the thread's CuPy memory hooks.
HOOK_NAME = "cudalab_history"

# cudalab's history contexts (torch's RecordContext): when a stack is captured and kept
_NEVER, _STATE, _ALLOC, _ALL = 0, 1, 2, 3
_CONTEXTS = {None: _NEVER, "state": _STATE, "alloc": _ALLOC, "all": _ALL}
_STACKS = ("python", "all", None)

#: The recording started last (running or stopped), read by :func:`current_recording`.
_current: CupyRecording | None = None
_start_lock = threading.Lock()
_now = time.time_ns


class _Device:
    """What one device's recording knows."""

    __slots__ = ("ring", "blocks", "segments", "before", "older_frees", "older_bytes",
                 "unseen_frees")

    def __init__(self, maxlen: int, before: int | None):
        self.ring = HistoryRing(maxlen)
        #: live block address -> (mem_size, requested size, stream, stack at allocation)
        self.blocks: dict[int, tuple[int, int, int, Stack | None]] = {}
        #: segment address -> (size, stream, stack at creation); segments seen created
        self.segments: dict[int, tuple[int, int, Stack | None]] = {}
        #: bytes of the pool's segments the recording did not see created (None: the pool's
        #: totals are not compared, see CupyRecording.compares_pool)
        self.before = before
        self.older_frees = 0  # frees of blocks allocated before the recording (not written)
        self.older_bytes = 0  # their bytes
        self.unseen_frees = 0  # blocks freed in another thread, found when reused


def _hook_class(base: type) -> type:
    """A subclass of CuPy's ``MemoryHook`` whose three postprocess callbacks are a
    :class:`CupyRecording`'s methods (made per CuPy module: cudalab never imports CuPy)."""

    class CudalabHistoryHook(base):  # type: ignore[misc, valid-type]
        """cudalab's history recorder among CuPy's memory hooks."""

        name = HOOK_NAME

        def __init__(self, recording: CupyRecording):
            self.recording = recording
            # CuPy calls these with its keyword arguments: the recording's own bound
            # methods take them, one Python call less per allocation and free
            self.malloc_postprocess = recording.on_malloc
            self.free_postprocess = recording.on_free
            self.alloc_postprocess = recording.on_segment

    return CudalabHistoryHook


def _check(context: Any, stacks: Any, max_entries: Any) -> None:
    if not (context is None or (isinstance(context, str) and context in _CONTEXTS)):
        raise ValueError(f"context must be one of None, 'state', 'alloc', 'all', got "
                         f"{context!r:.60}")
    if not (stacks is None or (isinstance(stacks, str) and stacks in _STACKS)):
        raise ValueError(f"stacks must be one of 'python', 'all', None, got {stacks!r:.60}")
    if type(max_entries) is not int or max_entries < 1:
        raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r:.60}")


class CupyRecording:
    """A recording of CuPy's pool allocations on the thread that started it (see the
    module). Made by :func:`record_cupy_history`; a context manager that stops it.

    Attributes
    ----------
    active : bool
        The hook is entered (False once :meth:`stop` ran).
    thread : int
        The thread recorded (the one that started it); ``thread_name`` is its name.
    context : str or None
        When stacks are captured, as :func:`cudalab.memory.record_history`'s; ``stacks``
        and ``max_entries`` likewise.
    backing : str
        :func:`~cudalab.memory_tools.libraries.cupy_backing` at the start: ``"pool"`` or
        ``"other"`` (a user's own ``MemoryPool``: recorded, its totals not compared).
    errors : int
        Hook calls that failed (never raised into CuPy: said in the snapshot's note, with
        ``last_error``).
    """

    def __init__(self, cupy: Any, context: str | None = "all", stacks: str | None = "all",
                 max_entries: int = sys.maxsize):
        _check(context, stacks, max_entries)
        base = getattr(getattr(cupy, "cuda", None), "MemoryHook", None)
        if not isinstance(base, type):
            raise SourceUnavailableError("cupy", "this CuPy has no cupy.cuda.MemoryHook (its "
                                                 "memory hook API), which the recording uses")
        backing = cupy_backing(cupy)
        if backing == "cudalab":
            raise SourceUnavailableError("cupy", CUPY_BACKED_BY_CUDALAB)
        self.cupy = cupy
        self.context, self.stacks, self.max_entries = context, stacks, max_entries
        self.level = _CONTEXTS[context] if stacks is not None else _NEVER
        self.backing = backing
        self.thread = threading.get_ident()
        self.thread_name = threading.current_thread().name
        self.started = time.time()
        self.stopped: float | None = None
        self.errors = 0
        self.last_error = ""
        self.devices: dict[int, _Device] = {}
        #: CuPy's current stream (its ``ptr`` is an entry's stream; 0 when it cannot say)
        self._stream: Callable[[], Any] = getattr(cupy.cuda, "get_current_stream", None) or (
            lambda: None)
        self.hook = _hook_class(base)(self)
        self.active = False
        self.hook.__enter__()  # (KeyError when a hook of this name is entered already)
        self.active = True

    # ------------------------------------------------------------------ the hook's calls
    @property
    def compares_pool(self) -> bool:
        """Whether the pool's ``total_bytes()`` is compared with the recorded segments (its
        default pool allocates, as at the start)."""
        return self.backing == "pool"

    def _device(self, device: int, adding: int = 0) -> _Device:
        dev = self.devices.get(device)
        if dev is None:  # (a device's first event: the pool's bytes before it)
            before = None
            if self.compares_pool:
                before = max(cupy_pool_figures(self.cupy, device, free_blocks=False)[1] - adding, 0)
            dev = self.devices[device] = _Device(self.max_entries, before)
        return dev

    def _entry(self, dev: _Device, action: str, addr: int, size: int, stream: int,
               frames: Stack | None) -> None:
        m = nvtx.thread_ranges.__dict__.get("messages") if nvtx.ranges_used else None
        young = dev.ring.young  # (HistoryRing.append inline: one call less per entry)
        young.append((action, addr, size, stream, _now(), frames, m[-1] if m else None,
                      current_cell()))
        if len(young) >= CHUNK:
            dev.ring.compact()

    def _stream_now(self) -> int:
        try:
            return int(self._stream().ptr)
        except Exception:
            return 0

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]

    def on_malloc(self, device_id: int = 0, size: int = 0, mem_size: int = 0,
                  mem_ptr: int = 0, pmem_id: int = 0, **_: Any) -> None:
        """``malloc_postprocess`` (CuPy's keywords): an ``alloc`` entry (an ``oom`` entry
        when the pool's malloc failed: ``mem_ptr`` 0 for a request of ``size`` > 0)."""
        try:
            dev = self.devices.get(device_id)
            if dev is None:
                dev = self._device(device_id)
            try:
                stream = int(self._stream().ptr)
            except Exception:
                stream = 0
            level = self.level
            if not mem_ptr:
                if size:  # CuPy's malloc raised (OutOfMemoryError): torch's "oom" entry
                    try:
                        free = int(self.cupy.cuda.runtime.memGetInfo()[0])
                    except Exception:
                        free = 0
                    fr = _stacks.capture_stack(0) if level >= _ALLOC else None
                    self._entry(dev, "oom", free, mem_size, stream, fr)
                return
            fr = _stacks.capture_stack(0) if level >= _STATE else None
            old = dev.blocks.get(mem_ptr)
            if old is not None:  # the pool hands it out again: it was freed unseen
                self._freed_unseen(dev, mem_ptr, old)
            dev.blocks[mem_ptr] = (mem_size, size, stream, fr)
            # (the entry written inline, as _entry writes it: the hot path)
            m = nvtx.thread_ranges.__dict__.get("messages") if nvtx.ranges_used else None
            young = dev.ring.young
            young.append(("alloc", mem_ptr, mem_size, stream, _now(),
                          fr if level >= _ALLOC else None, m[-1] if m else None,
                          current_cell()))
            if len(young) >= CHUNK:
                dev.ring.compact()
        except Exception as exc:  # (inside CuPy's malloc: never raised into it)
            self._failed(exc)

    def _freed_unseen(self, dev: _Device, ptr: int,
                      block: tuple[int, int, int, Stack | None]) -> None:
        """A block the recording holds live comes out of the pool again: another thread
        freed it (CuPy's hooks are per thread). Its free entries are written now, so the
        trace stays one the replay reads, and counted (the snapshot's note says so)."""
        fr = block[3] if self.level >= _ALLOC else None
        self._entry(dev, "free_requested", ptr, block[0], block[2], fr)
        self._entry(dev, "free_completed", ptr, block[0], block[2], fr)
        dev.unseen_frees += 1

    def on_free(self, device_id: int = 0, mem_size: int = 0, mem_ptr: int = 0,
                pmem_id: int = 0, **_: Any) -> None:
        """``free_postprocess`` (CuPy's keywords): ``free_requested`` and
        ``free_completed`` (CuPy's pool takes the block back at once, in stream order), or
        a count for an older block."""
        try:
            dev = self.devices.get(device_id)
            if dev is None:
                dev = self._device(device_id)
            block = dev.blocks.pop(mem_ptr, None)
            if block is None:
                dev.older_frees += 1
                dev.older_bytes += mem_size
                return
            size, stream, fr = block[0], block[2], block[3]
            level = self.level
            if level == _ALL:
                fr = _stacks.capture_stack(0)
            elif level < _ALLOC:
                fr = None
            m = nvtx.thread_ranges.__dict__.get("messages") if nvtx.ranges_used else None
            nvtx_range = m[-1] if m else None
            cell = current_cell()
            t = _now()
            young = dev.ring.young
            young.append(("free_requested", mem_ptr, size, stream, t, fr, nvtx_range, cell))
            young.append(("free_completed", mem_ptr, size, stream, t, fr, nvtx_range, cell))
            if len(young) >= CHUNK:
                dev.ring.compact()
        except Exception as exc:  # (CuPy frees in __dealloc__: nothing may escape)
            self._failed(exc)

    def on_segment(self, device_id: int = 0, mem_size: int = 0, mem_ptr: int = 0,
                   **_: Any) -> None:
        """``alloc_postprocess`` (CuPy's keywords): a ``segment_alloc`` entry, after the
        ``segment_free`` entries of the segments the pool released since (see
        :meth:`reconcile`)."""
        if not mem_ptr:  # the cudaMalloc failed (CuPy frees its cache and retries)
            return
        try:
            dev = self._device(device_id, adding=mem_size)
            self.reconcile(device_id, adding=mem_size)
            stream = self._stream_now()
            fr = _stacks.capture_stack(0) if self.level >= _ALLOC else None
            dev.segments[mem_ptr] = (mem_size, stream, fr)
            self._entry(dev, "segment_alloc", mem_ptr, mem_size, stream, fr)
        except Exception as exc:
            self._failed(exc)

    def reconcile(self, device: int, adding: int = 0) -> int:
        """Write the segment frees the pool made without a hook (``free_all_blocks``).

        When the pool's ``total_bytes()`` (less ``adding``, a segment being recorded) is
        below the bytes of the segments known, every known segment of ``device`` holding no
        live block was released (the pool releases exactly those: a free segment is one
        unsplit free chunk); each gets a ``segment_free`` entry. Returns how many.
        """
        dev = self.devices.get(device)
        if dev is None or dev.before is None or not self.active:
            return 0
        if cupy_backing(self.cupy) != "pool":
            return 0
        total = cupy_pool_figures(self.cupy, device, free_blocks=False)[1] - adding
        known = sum(s[0] for s in dev.segments.values())
        if total >= dev.before + known:
            dev.before = total - known  # (another thread's or pool's segments: not seen)
            return 0
        starts = sorted(dev.segments)
        held = set()
        for ptr in dev.blocks:
            i = bisect.bisect_right(starts, ptr) - 1
            if i >= 0 and ptr < starts[i] + dev.segments[starts[i]][0]:
                held.add(starts[i])
        gone = [a for a in starts if a not in held]
        for addr in gone:
            size, stream, fr = dev.segments.pop(addr)
            self._entry(dev, "segment_free", addr, size, stream,
                        fr if self.level >= _ALLOC else None)
        dev.before = max(total - sum(s[0] for s in dev.segments.values()), 0)
        return len(gone)

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """Leave CuPy's hooks (the segment frees made meanwhile are written first); what
        was recorded stays readable. Idempotent.

        Raises
        ------
        RuntimeError
            Called from another thread than the one that started the recording (CuPy's
            hooks are that thread's).
        """
        if not self.active:
            return
        if threading.get_ident() != self.thread:
            raise RuntimeError(f"the CuPy recording runs on thread {self.thread_name!r}: "
                               "stop it from that thread (CuPy's memory hooks are per thread)")
        for device in list(self.devices):
            try:
                self.reconcile(device)
            except Exception as exc:
                self._failed(exc)
        self.active = False
        self.stopped = time.time()
        try:
            self.hook.__exit__(None, None, None)
        except KeyError:  # the user left the hook already (memory_hook's dict)
            pass

    def __enter__(self) -> CupyRecording:
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        self.stop()
        return False

    def __repr__(self) -> str:
        state = "recording" if self.active else "stopped"
        n = sum(len(d.ring) for d in self.devices.values())
        return f"<CupyRecording {state} on thread {self.thread_name!r}: {n} trace entries>"

    # ------------------------------------------------------------------ reading
    def entry_count(self) -> int:
        """Trace entries held, every device."""
        return sum(len(d.ring) for d in self.devices.values())

    def raw_entries(self, device: int) -> list[TraceEntry]:
        """The trace entry tuples of ``device``, oldest first (cudalab's ``FIELDS``)."""
        dev = self.devices.get(device)
        return [] if dev is None else dev.ring.entries()

    def _segments(self, device: int, dev: _Device, cache: FrameCache) -> list[dict[str, Any]]:
        """The device's segments in torch's schema: each segment seen, tiled by its live
        blocks and the inactive gaps between them; a live block in a segment not seen (an
        older one) as a segment of its own size, ``segment_seen`` False."""
        to_dicts = _stacks.frames_to_dicts
        segments, live = dict(dev.segments), dict(dev.blocks)  # (copies: the hook may write)
        inside: dict[int, list[int]] = {a: [] for a in segments}
        starts = sorted(segments)
        alone = []
        for ptr in sorted(live):
            i = bisect.bisect_right(starts, ptr) - 1
            if i >= 0 and ptr < starts[i] + segments[starts[i]][0]:
                inside[starts[i]].append(ptr)
            else:
                alone.append(ptr)

        def block(ptr: int) -> dict[str, Any]:
            size, requested, _, fr = live[ptr]
            return {"address": ptr, "size": size, "requested_size": requested,
                    "state": "active_allocated", "frames": to_dicts(fr, cache) if fr else []}

        def segment(addr: int, total: int, stream: int, blocks: list[dict[str, Any]],
                    frames: Stack | None, seen: bool) -> dict[str, Any]:
            alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            return {"device": device, "address": addr, "total_size": total,
                    "allocated_size": alloc, "active_size": alloc,
                    "requested_size": sum(b["requested_size"] for b in blocks
                                          if b["state"] == "active_allocated"),
                    "stream": stream, "segment_type": "large", "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": to_dicts(frames, cache) if frames else [], "blocks": blocks,
                    "segment_seen": seen}

        out = []
        for addr in starts:
            total, stream, fr = segments[addr]
            blocks: list[dict[str, Any]] = []
            at = addr
            for ptr in inside[addr]:
                if ptr > at:
                    blocks.append({"address": at, "size": ptr - at, "requested_size": 0,
                                   "state": "inactive", "frames": []})
                blocks.append(block(ptr))
                at = ptr + live[ptr][0]
            if at < addr + total:
                blocks.append({"address": at, "size": addr + total - at, "requested_size": 0,
                               "state": "inactive", "frames": []})
            out.append(segment(addr, total, stream, blocks, fr, True))
        for ptr in alone:
            b = block(ptr)
            out.append(segment(ptr, b["size"], live[ptr][2], [b], None, False))
        out.sort(key=lambda s: s["address"])
        return out

    def note(self, pools: list[dict[str, Any]]) -> str:
        """What the snapshot shows and what it cannot, in words."""
        when = time.strftime("%H:%M:%S", time.localtime(self.started))
        state = ("recording" if self.active else
                 f"stopped at {time.strftime('%H:%M:%S', time.localtime(self.stopped or 0))}")
        parts = [f"CuPy's pool as recorded with CuPy's memory hooks since {when} ({state}) on "
                 f"thread {self.thread_name!r} only (CuPy's hooks are per thread): only what "
                 "was allocated since the recording started is shown"]
        for p in pools:
            figures = ""
            if "used_bytes" in p:
                figures = (f"; the pool itself: {format_bytes(p['used_bytes'])} used of "
                           f"{format_bytes(p['total_bytes'])} (MemoryPool.used_bytes/"
                           "total_bytes)")
            parts.append(f"cuda:{p['device']}: {format_bytes(p['recorded_used_bytes'])} in "
                         f"live blocks recorded, {format_bytes(p['recorded_segment_bytes'])} "
                         f"in segments seen{figures}")
            if p["older_frees"]:
                n = p["older_frees"]
                parts.append(f"cuda:{p['device']}: {n} free{'s' if n > 1 else ''} "
                             f"({format_bytes(p['older_bytes'])}) of blocks allocated before "
                             "the recording are not in the trace")
            n = p.get("unseen_frees", 0)
            if n:
                parts.append(f"cuda:{p['device']}: {n} block{'s were' if n > 1 else ' was'} "
                             "freed outside the recorded thread (the free is written when "
                             "the pool hands the address out again)")
        if self.backing != "pool":
            parts.append("CuPy allocated through another pool than its default one at the "
                         "start: the pool totals are not compared (released segments are "
                         "not seen)")
        if self.errors:
            parts.append(f"{self.errors} hook calls failed (last: {self.last_error})")
        return "; ".join(parts)

    def snapshot(self) -> dict[str, Any]:
        """The recording as a snapshot in torch's schema (see the module): ``segments``
        (those seen, with the live blocks recorded), ``device_traces``,
        ``allocator_settings`` (empty: CuPy's pool has none of torch's), ``identity``
        (allocator ``"cupy"``) and ``cudalab``: ``note``, ``cupy_pool`` (per device: the
        recorded live and segment bytes, and while recording the pool's ``used_bytes`` and
        ``total_bytes``) and ``recording`` (the settings)."""
        cache: FrameCache = {}
        devices = sorted(self.devices)
        if threading.get_ident() == self.thread:  # (only the recorded thread writes entries)
            for d in devices:
                try:
                    self.reconcile(d)
                except Exception as exc:
                    self._failed(exc)
        segments: list[dict[str, Any]] = []
        pools: list[dict[str, Any]] = []
        for d in devices:
            dev = self.devices[d]
            segments.extend(self._segments(d, dev, cache))
            pool: dict[str, Any] = {
                "device": d,
                "recorded_used_bytes": sum(b[0] for b in list(dev.blocks.values())),
                "recorded_segment_bytes": sum(s[0] for s in list(dev.segments.values())),
                "older_frees": dev.older_frees, "older_bytes": dev.older_bytes,
                "unseen_frees": dev.unseen_frees}
            if self.active:
                try:
                    used, total, _ = cupy_pool_figures(self.cupy, d, free_blocks=False)
                    pool.update(used_bytes=used, total_bytes=total)
                except Exception as exc:
                    self._failed(exc)
            pools.append(pool)
        n = devices[-1] + 1 if devices else 0
        traces = [[entry_to_dict(e, d, cache) for e in self.raw_entries(d)] for d in range(n)]
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": {},
            "external_annotations": [],
            "identity": Identity.current(allocator="cupy").to_dict(),
            "cudalab": {
                "note": self.note(pools),
                "cupy_pool": pools,
                "recording": {"context": self.context, "stacks": self.stacks,
                              "max_entries": self.max_entries, "thread": self.thread_name,
                              "active": self.active, "backing": self.backing},
            },
        }


def record_cupy_history(cupy: Any = None, *, context: str | None = "all",
                        stacks: str | None = "all", max_entries: int = sys.maxsize
                        ) -> CupyRecording:
    """Record CuPy's pool allocations on this thread, with CuPy's own memory hooks.

    ``history_frame(source="cupy")``, ``SnapshotViewer(source="cupy")``,
    ``what_if(source="cupy")`` and ``%cuda_memory`` with ``--source cupy`` read the
    recording (see the module for what CuPy's hooks let it see).

    Parameters
    ----------
    cupy : module, optional
        The CuPy module (default: ``import cupy``, as naming the source does).
    context, stacks : str or None, optional
        When stacks are captured, as :func:`cudalab.memory.record_history`'s (default
        ``"all"`` and ``"all"``; ``stacks=None`` captures none).
    max_entries : int, optional
        The most trace entries kept per device, oldest dropped first (default: no bound).

    Returns
    -------
    CupyRecording
        Recording already; ``stop()`` (or the end of a ``with`` block) ends it, keeping what
        it recorded readable until the next recording starts.

    Raises
    ------
    SourceUnavailableError
        No CuPy, CuPy without CUDA or without its hook API, or CuPy backed by cudalab's
        allocator (whose own history records CuPy's arrays).
    ValueError
        Bad settings.
    RuntimeError
        A CuPy recording runs already (stop it first).
    """
    global _current
    from cudalab.memory_tools.libraries import cupy_with_cuda

    _check(context, stacks, max_entries)
    cupy = cupy_with_cuda(cupy)
    with _start_lock:
        running = _current
        if running is not None and running.active:
            raise RuntimeError(f"a CuPy recording runs already (thread "
                               f"{running.thread_name!r}): stop it first")
        try:
            recording = CupyRecording(cupy, context=context, stacks=stacks,
                                      max_entries=max_entries)
        except KeyError:
            raise RuntimeError(f"a CuPy memory hook named {HOOK_NAME!r} is entered on this "
                               "thread already") from None
        _current = recording
    return recording


def current_recording() -> CupyRecording | None:
    """The CuPy recording started last, running or stopped (None: none in this process)."""
    return _current


# Ctrl-C waits until a hook call returns (CuPy calls them inside malloc and in __dealloc__,
# where an exception is lost) and until the segment frees are all written.
_interrupts.guard(CupyRecording.on_malloc, CupyRecording.on_free, CupyRecording.on_segment,
                  CupyRecording.reconcile, CupyRecording._entry)
