"""Allocation history: torch's ``_record_memory_history`` for cudalab's allocators.

:func:`_record_memory_history` (public alias :func:`record_history`, also a context manager)
turns on a recorder in every allocator, existing or created later, on every device. With
recording off each allocator's ``_trace`` hook is None, so the allocators do no work for it.

Settings, as torch's ``torch.cuda.memory._record_memory_history``:

* ``enabled``: None (off; the recorded history is dropped), ``"state"`` (only the stacks of
  live blocks, for snapshots; the trace ring holds a single entry, as torch's) or ``"all"``
  (also a ring buffer of trace entries). A bool first argument selects torch's legacy
  signature ``(enabled, record_context=True, trace_alloc_max_entries=1,
  trace_alloc_record_context=False, device=None, record_context_cpp=False, ...)``.
* ``context``: when stacks are captured. None: never; ``"state"``: at allocation, kept on the
  live block for snapshots only; ``"alloc"``: also attached to the alloc trace entries (free
  entries then carry the allocation's stack, as torch's); ``"all"``: free entries carry the
  stack of the code that freed.
* ``stacks``: ``"python"`` or ``"all"``. cudalab has no C++ frames, so both capture the same
  Python frames (cudalab's own frames are left out). ``None`` (a cudalab extension) captures
  no stack at all, whatever ``context`` says.
* ``max_entries``: size of the per-device ring buffer; once full the oldest entry is
  overwritten. Entries read back oldest to newest.
* ``clear_history=True`` drops what was recorded so far; ``skip_actions`` (newer torch) lists
  actions not to record; ``device``, ``compile_context`` and ``global_record_annotations``
  are accepted for torch compatibility and ignored.

Entries are stored compactly as tuples ``(action, addr, size, stream, time_ns, frames,
nvtx_range, cell)`` (see :data:`FIELDS`), one ring (a ``collections.deque``) per device;
``frames`` is None or a flat tuple ``(code, lasti, code, lasti, ...)`` innermost first, turned
into ``{"filename", "line", "name"}`` dicts only when a snapshot is taken
(:func:`frames_to_dicts`). For an ``oom`` entry ``addr`` holds the bytes free on the device.
``nvtx_range`` is the innermost open :mod:`cudalab.nvtx` range of the thread, ``cell`` the
notebook cell id set with :func:`set_current_cell`.

Stacks are walked with ``sys._getframe`` and stored as (code, instruction offset) pairs;
cudalab's own frames (found by module name on Python 3.12+, by file before) are left out.
A running frame's stack at a given instruction cannot change until it returns, so each frame
caches its stacks on itself (a small object set as its ``f_trace``, gone with the frame):
the walk stops at the first frame that knows the rest (a notebook cell's ~25 kernel frames
are walked once per cell, a loop's allocations once per call site), and the entries of a
loop share one stack tuple. Generator and coroutine frames are not cached, nothing is
cached while a trace function (a debugger, coverage) is set, and a frame's own
``f_trace`` is never replaced. Memo pairs (a loop allocating and freeing one size) are
logged by the allocator as stamps (time, stack) and written out as entries before anything
reads the history. The stamp has a C twin, ``cudalab.memory_tools._stackstamp`` (CPython
3.11-3.13, built optionally at install; ``CUDALAB_PURE_PYTHON=1`` turns it off): it reads
the interpreter's frames instead of making frame objects for cudalab's own, for the same
stacks at less than half the cost (:func:`stamp_implementation` says which is used).

As torch: ``enabled="state"`` with the default ``context="all"`` still captures a stack at
each free (kept nowhere but torch does the same); taking a snapshot (``_snapshot()`` and
``memory_snapshot()``) appends a ``snapshot`` entry per device while recording.

Differences from torch: turning recording off also forgets the stacks of live blocks (torch
keeps them on its blocks until they are freed); the pluggable allocator records too (torch's
raises); :class:`HistoryRecording` (the context manager) leaves what it recorded readable
after the block when recording was off before it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from cudalab import nvtx as _nvtx
from cudalab.allocator import allocator as _alloc
from cudalab.nvtx import _tls as _nvtx_tls

__all__ = [
    "ACTIONS",
    "FIELDS",
    "HistoryRecording",
    "_record_memory_history",
    "attach_allocator",
    "current_cell",
    "detach_allocator",
    "devices_with_history",
    "frames_to_dicts",
    "history_settings",
    "is_recording",
    "raw_entries",
    "record_history",
    "set_current_cell",
    "trace_entries",
]

#: Every trace action, in torch's order.
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
#: The fields of a raw entry tuple (:func:`raw_entries`).
FIELDS = ("action", "addr", "size", "stream", "time_ns", "frames", "nvtx_range", "cell")

# torch's RecordContext
_NEVER, _STATE, _ALLOC, _ALL = 0, 1, 2, 3
_CONTEXTS = {None: _NEVER, "state": _STATE, "alloc": _ALLOC, "all": _ALL}
_ENABLED = (None, "state", "all")
_STACKS = ("python", "all", None)


def _choices(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) for v in values)


# --------------------------------------------------------------------------- notebook cell
_cell: str | None = None


def set_current_cell(cell_id: Any) -> None:
    """Set the notebook cell id recorded on new entries (None: no cell). The IPython
    extension calls this before each cell runs."""
    global _cell
    new = None if cell_id is None else str(cell_id)
    if new != _cell and _settings is not None:
        _sync_allocators()  # pairs logged as stamps belong to the old cell
    _cell = new


def current_cell() -> str | None:
    """The cell id set by :func:`set_current_cell`."""
    return _cell


# --------------------------------------------------------------------------- stacks
_getframe = sys._getframe
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_internal: dict[str, bool] = {}  # co_filename -> inside the cudalab package


def _is_internal(filename: str) -> bool:
    try:
        path = os.path.abspath(filename)
    except (TypeError, ValueError):
        return False
    return path.startswith(_PKG)


# Stacks are cached on the frames themselves. While a frame runs, the frames beyond it do
# not change (they wait in their calls), so its stack at a given instruction is fixed for
# its whole run. A frame's cache is a _Mark set as its ``f_trace``: the frames own it, so
# it lives as long as the frames that use it (no frame, local or id is kept anywhere else),
# and a later frame at a reused address has no mark. Frames share a mark only when their
# stacks are the same at every instruction (one code, called from one place of one
# running frame: see _Mark). Generator and coroutine frames are never marked: the frames
# beyond them change at every resumption.
# Frames are marked only while no trace function is set (sys.settrace), and only when
# their f_trace is free, so debuggers and coverage keep theirs.
_NO_MARK = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ITERABLE_COROUTINE,
#                                         CO_ASYNC_GENERATOR
_gettrace = sys.gettrace
_modname = getattr(sys, "_getframemodulename", None)
_now = time.time_ns
# Names of the modules whose frames are on captured stacks, by whether they are cudalab's
# (None, a frame without a module name or beyond the stack, is in neither).
_cud_mods: set = set()
_other_mods: set = set()


_MARK_MAX = 256  # entries one mark keeps (a frame calling ever new code objects)


class _Mark(dict):
    """The stacks of running frames: instruction offset -> the flat stack from the frame
    outwards, and (offset, id of a code) -> (that code, the _Mark of the frames of that
    code called from there). A frame's stack at an offset depends only on its code and on
    its caller's stack at the call, both fixed while it runs, so the frames of one code
    called from one place (a function a loop calls: a new frame each iteration) share one
    mark. A trace function set later calls it as a frame's local trace function; it then
    does nothing, as a frame without one."""

    __slots__ = ()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        return None


def _capture(d: int) -> tuple:
    """The Python stack of the caller from its ``d``-th frame outwards (0: its own),
    without cudalab's own frames at its start, innermost first, as a flat tuple (code,
    lasti, code, lasti, ...). Lines are computed from lasti only when a snapshot is taken.
    Equal stacks of one running frame are one tuple object. The allocator method calling
    the hook is cudalab's: callers pass the depth of that method's caller."""
    d += 1  # this frame
    if _modname is not None:
        # Python 3.12+: find the first frame outside cudalab by its module's name, which
        # needs no frame object for cudalab's own frames (making one costs ~100 ns).
        while True:
            name = _modname(d)
            try:
                if name in _cud_mods:
                    d += 1
                    continue
                if name is None or name in _other_mods:
                    break
            except TypeError:  # a function's __module__ set to something unhashable
                break
            if type(name) is str and name.partition(".")[0] == "cudalab":
                _cud_mods.add(name)
            else:
                _other_mods.add(name)
        try:
            f = _getframe(d)
        except ValueError:  # beyond the stack: all of it is cudalab's
            return ()
    else:
        try:
            f = _getframe(d)
        except ValueError:
            return ()
        internal = _internal
        while True:
            fn = f.f_code.co_filename
            flag = internal.get(fn)
            if flag is None:
                flag = internal[fn] = _is_internal(fn)
            if not flag:
                break
            f = f.f_back
            if f is None:
                return ()
    li = f.f_lasti
    m = f.f_trace
    if type(m) is not _Mark or (t := m.get(li)) is None:
        t = _miss(f, li, m)
    return t


if _modname is not None:
    def _stamp() -> tuple:
        """The memo's stamp of an allocation (or of a free, when frees carry their own
        stack): ``(time, stack)``, the stack as ``_capture(2)`` makes it. The allocator
        method calls it directly. Its common case (the first frame outside cudalab has
        a mark that knows its stack) is written out here: no further call."""
        d = 2
        name = _modname(2)
        try:
            while name in _cud_mods:
                d += 1
                name = _modname(d)
            if name in _other_mods or name is None:
                try:
                    f = _getframe(d)
                except ValueError:  # beyond the stack: all of it is cudalab's
                    return _now(), ()
                m = f.f_trace
                if m.__class__ is _Mark:
                    t = m.get(f.f_lasti)
                    if t is not None:
                        return _now(), t
        except TypeError:  # an unhashable module name: _capture copes
            pass
        return _now(), _capture(2)
else:
    def _stamp() -> tuple:
        """The memo's stamp of an allocation (or of a free, when frees carry their own
        stack): ``(time, stack)``. The allocator method calls it directly."""
        return _now(), _capture(2)


_py_stamp = _stamp


def _pure_python_requested() -> bool:
    """Whether ``CUDALAB_PURE_PYTHON`` asks for the pure-Python stamp (unset, empty or 0:
    no; setup.py reads it the same way, to skip building the compiled one)."""
    return os.environ.get("CUDALAB_PURE_PYTHON", "0") not in ("", "0")


def _load_compiled_stamp() -> Callable[[], tuple] | None:
    """``cudalab.memory_tools._stackstamp.stamp`` set up over this module's state, or None where
    it is not built (another Python, no compiler at install time; see setup.py) or
    ``CUDALAB_PURE_PYTHON`` is set. It is ``_stamp`` in C over CPython's interpreter frames:
    the same stacks at less than half the cost. A module that is there but does not fit (built
    from other sources) is reported and left unused."""
    if _pure_python_requested():
        return None
    try:
        from cudalab.memory_tools import _stackstamp
    except ImportError:
        return None
    try:
        api = getattr(_stackstamp, "API", None)
        if api != 1:
            raise TypeError(f"API {api!r}, expected 1")
        # The objects are shared, not copied: they are filled in place and never rebound.
        _stackstamp.setup(_cud_mods, _other_mods, _internal, _Mark, _capture)
    except Exception as exc:  # noqa: BLE001  (a stale build must not break recording)
        warnings.warn(f"cudalab.memory_tools._stackstamp ({_stackstamp.__file__}) is not usable, "
                      f"using the pure-Python stamp: {exc}. Reinstall cudalab to rebuild it.",
                      RuntimeWarning, stacklevel=2)
        return None
    return _stackstamp.stamp


_c_stamp = _load_compiled_stamp()
if _c_stamp is not None:
    _stamp = _c_stamp


def stamp_implementation() -> str:
    """Which stamp recordings with Python stacks use: ``"compiled"`` (the C accelerator,
    CPython 3.11-3.13) or ``"python"``. Both give the same stacks."""
    return "compiled" if _c_stamp is not None and _stamp is _c_stamp else "python"


def _use_stamp(kind: str) -> None:
    """Choose the stamp of the recordings started from now on (tests, benchmarks)."""
    global _stamp
    if kind == "python":
        _stamp = _py_stamp
    elif kind == "compiled":
        if _c_stamp is None:
            raise RuntimeError("cudalab.memory_tools._stackstamp is not built for this Python "
                               "(or CUDALAB_PURE_PYTHON is set)")
        _stamp = _c_stamp
    else:
        raise ValueError(f"stamp must be 'python' or 'compiled', got {kind!r}")


def _miss(f: Any, li: int, m: Any) -> tuple:
    """The stack of frame ``f`` at ``li`` when its mark ``m`` (its f_trace) does not know
    it: from the mark its caller keeps for its code (then also set as its own), else by a
    walk."""
    c = f.f_back
    if c is not None:
        mc = c.f_trace
        if type(mc) is _Mark:
            code = f.f_code
            cli = c.f_lasti
            e = mc.get((cli, id(code)))  # (the entry holds the code: its id stays its own)
            if e is not None:
                shared = e[1]
                if m is None and not code.co_flags & _NO_MARK and _gettrace() is None:
                    f.f_trace = m = shared
                t = shared.get(li)
                if t is None:
                    tail = mc.get(cli)
                    if tail is None:
                        return _walk(f, li)
                    t = _shared((code, li) + tail)
                    if len(shared) >= _MARK_MAX:
                        shared.clear()
                    shared[li] = t
                if type(m) is _Mark and m is not shared:
                    m[li] = t
                return t
    return _walk(f, li)


def _walk(f0: Any, li0: int) -> tuple:
    """The stack from frame ``f0`` (at ``li0``) outwards, up to the first frame whose mark
    knows the rest, marking the frames walked."""
    walked: list = [f0, li0]  # frames without a cached stack, innermost first, with lasti
    ap = walked.append
    f = f0.f_back
    t = ()
    while f is not None:
        li = f.f_lasti
        m = f.f_trace
        if type(m) is _Mark:
            c = m.get(li)
            if c is not None:
                t = c
                break
        ap(f)
        ap(li)
        f = f.f_back
    mark = _gettrace() is None
    # the caller's mark and offset, for the outermost frame walked
    cm = f.f_trace if f is not None else None
    cli = li if f is not None else 0
    for i in range(len(walked) - 2, -1, -2):  # outermost first: each adds one frame to t
        f = walked[i]
        li = walked[i + 1]
        code = f.f_code
        t = (code, li) + t
        if i == 0:
            t = _shared(t)
        m = f.f_trace
        if m is None and mark and not code.co_flags & _NO_MARK:
            if type(cm) is _Mark:  # the mark of the frames of this code called from there
                key = (cli, id(code))
                e = cm.get(key)
                if e is None:
                    if len(cm) >= _MARK_MAX:
                        cm.clear()
                    e = cm[key] = (code, _Mark())
                m = e[1]
            else:
                m = _Mark()
            f.f_trace = m
        if type(m) is _Mark:
            if len(m) >= _MARK_MAX:
                m.clear()
            m[li] = t
            cm = m
        else:
            cm = None
        cli = li
    return t


# The last stack captured at each call site (innermost code and instruction): a stack
# equal to it is replaced by it, so the entries of new frames at one site (a function that
# a loop calls, deeper than the loop's frame) share one tuple, in the ring and when a
# snapshot converts it.
_sites: dict = {}


def _shared(t: tuple) -> tuple:
    key = (id(t[0]), t[1])
    prev = _sites.get(key)
    if prev == t:  # element identity first: cheap for equal stacks
        return prev
    if len(_sites) >= 8192:
        _sites.clear()
    _sites[key] = t
    return t


def _line_of(code: Any, lasti: int) -> int:
    if lasti >= 0:
        for start, end, line in code.co_lines():
            if start <= lasti < end:
                return line if line is not None else code.co_firstlineno
    return code.co_firstlineno


def frames_to_dicts(frames: tuple | None, cache: dict | None = None) -> list[dict]:
    """torch's frame dicts ``{"filename", "line", "name"}`` (innermost first) of a raw
    ``frames`` field. Pass the same ``cache`` dict for many conversions of one snapshot:
    identical frames then share their dict objects (and equal stacks their lists)."""
    if not frames:
        return []
    if cache is None:
        cache = {}
    key = id(frames)
    hit = cache.get(key)
    if hit is not None and hit[0] is frames:
        return hit[1]
    out = []
    for i in range(0, len(frames), 2):
        code = frames[i]
        lasti = frames[i + 1]
        fkey = (id(code), lasti)
        d = cache.get(fkey)
        if d is None:
            d = cache[fkey] = {"filename": code.co_filename, "line": _line_of(code, lasti),
                               "name": code.co_name}
            cache[("code", id(code))] = code  # keep the code alive while the cache is used
        out.append(d)
    cache[key] = (frames, out)
    return out


# --------------------------------------------------------------------------- state
class _Settings(NamedTuple):
    """One recording configuration."""

    enabled: str
    context: str | None
    stacks: str | None
    max_entries: int
    level: int
    skip: frozenset


class _Recorder:
    """Per-allocator bookkeeping: stacks of live blocks and segments, hand-over state."""

    __slots__ = ("device", "blocks", "segs", "pending", "last_free", "__weakref__")

    def __init__(self, device: int):
        self.device = device
        self.blocks: dict[int, tuple] = {}  # live block address -> frames at allocation
        self.segs: dict[int, tuple] = {}  # segment address -> frames at creation
        self.pending: tuple | None = None  # (thread, frames) of a segment_alloc for its alloc
        self.last_free: tuple | None = None  # (addr, frames) of the last free_requested

    def clear(self) -> None:
        self.blocks.clear()
        self.segs.clear()
        self.pending = self.last_free = None


_lock = threading.RLock()
_settings: _Settings | None = None
_rings: dict[int, deque] = {}
_recorders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # allocator -> _Recorder
_extra: weakref.WeakSet = weakref.WeakSet()  # allocators attached by attach_allocator()
_hooked = False


class _NvtxAlwaysUsed:
    _used = True


def _nvtx_flag() -> Any:
    """An object whose ``_used`` says whether any NVTX range was ever pushed: the
    ``cudalab.nvtx`` module when it keeps that flag (then a process that never uses NVTX
    skips the thread-local lookup of the open range), else a stand-in that always says yes."""
    return _nvtx if hasattr(_nvtx, "_used") else _NvtxAlwaysUsed


def _make_trace(rec: _Recorder, level: int, append: Callable[[tuple], None]) -> Callable:
    """The allocator hook ``trace(action, addr, size, stream)`` for one recorder."""
    now = _now
    nvtls = _nvtx_tls
    nv = _nvtx_flag()

    if level == _NEVER:
        def trace(action: str, addr: int, size: int, stream: int) -> None:
            m = nvtls.__dict__.get("messages") if nv._used else None
            append((action, addr, size, stream, now(), None, m[-1] if m else None, _cell))

        def pairs(addr: int, size: int, stream: int, times: Any) -> None:
            """The entries of memo pairs that the allocator logged compactly, pairs of
            (free time, alloc time), 0 for nothing: what ``trace`` would have appended then,
            in order."""
            cell = _cell
            it = iter(times)
            for f, t in zip(it, it):
                if f:
                    append(("free_requested", addr, size, stream, f, None, None, cell))
                    append(("free_completed", addr, size, stream, f, None, None, cell))
                if t:
                    append(("alloc", addr, size, stream, t, None, None, cell))

        # Entries without stacks carry nothing but the time: the memo's stamps are times.
        return _compact(trace, pairs, now, now, nv)

    blocks = rec.blocks
    segs = rec.segs
    cap = _capture
    getframe = _getframe
    ident = threading.get_ident
    on_alloc = level >= _ALLOC
    on_free = level == _ALL

    def trace(action: str, addr: int, size: int, stream: int) -> None:  # noqa: C901
        # called by an allocator method: cap(2) starts at that method's caller
        if action == "alloc":
            p = rec.pending
            if p is not None and p[0] == ident():
                rec.pending = None
                fr = p[1]
            else:
                fr = cap(2)
            blocks[addr] = fr
            ef = fr if on_alloc else None
        elif action == "free_requested":
            if on_free:
                fr = cap(2)
                f1 = getframe(1)  # the allocator method freeing, to spot a completion inside it
                rec.last_free = (addr, fr, id(f1), f1.f_code)
                ef = fr
            elif on_alloc:
                ef = blocks.get(addr)
            else:
                ef = None
        elif action == "free_completed":
            fr = blocks.pop(addr, None)
            if on_free:
                lf = rec.last_free
                if lf is not None and lf[0] == addr:
                    rec.last_free = None
                    # Completed inside the same free call (torch passes the free's stack)
                    # or later, when record_stream events completed (the allocation's).
                    f1 = getframe(1)
                    f2 = f1.f_back
                    if (id(f1) == lf[2] and f1.f_code is lf[3]) or (
                            f2 is not None and id(f2) == lf[2] and f2.f_code is lf[3]):
                        fr = lf[1]
            ef = fr if on_alloc else None
        elif action == "segment_alloc" or action == "segment_map":
            p = rec.pending
            if p is not None and p[0] == ident():
                fr = p[1]
            else:
                fr = cap(2)
                rec.pending = (ident(), fr)
            if addr not in segs:
                segs[addr] = fr
            ef = fr if on_alloc else None
        elif action == "segment_free" or action == "segment_unmap":
            fr = segs.pop(addr, None)
            if on_free:
                fr = cap(2)
            ef = fr if on_alloc else None
        elif action == "oom":
            p = rec.pending
            rec.pending = None
            fr = p[1] if p is not None and p[0] == ident() else cap(2)
            ef = fr if on_alloc else None
        else:
            ef = None
        m = nvtls.__dict__.get("messages") if nv._used else None
        append((action, addr, size, stream, now(), ef, m[-1] if m else None, _cell))

    # Memo pairs are logged compactly too (see _compact): their stamps are (time, stack)
    # for an allocation, and for a free when frees carry their own stack (context "all"),
    # else the time. The allocator method calls the stamp (_stamp) directly.

    def pairs_with_stacks(addr: int, size: int, stream: int, stamps: Any) -> None:
        """The entries of memo pairs that the allocator logged as (free stamp, alloc
        stamp) pairs, 0 for nothing: what ``trace`` would have appended then, in order,
        with the block's stack kept as ``trace`` keeps it."""
        cell = _cell
        it = iter(stamps)
        for f, a in zip(it, it):
            if f:
                fr = blocks.pop(addr, None)
                if on_free:
                    t, fr = f
                else:
                    t = f
                    if not on_alloc:
                        fr = None
                append(("free_requested", addr, size, stream, t, fr, None, cell))
                append(("free_completed", addr, size, stream, t, fr, None, cell))
            if a:
                t, fr = a
                blocks[addr] = fr
                append(("alloc", addr, size, stream, t, fr if on_alloc else None, None, cell))

    return _compact(trace, pairs_with_stacks, _stamp, _stamp if on_free else now, nv)


def _compact(trace: Any, pairs: Callable, now: Callable, free_now: Callable, nv: Any) -> Any:
    """``trace`` with what the allocator needs to log memo pairs compactly: ``now()`` and
    ``free_now()`` make the alloc and free stamps, ``pairs(addr, size, stream, stamps)``
    writes them out as entries. That is possible as long as no NVTX range was ever pushed
    and the cell stays the same (set_current_cell and the first NVTX push flush the
    allocators first), since entries then carry nothing else."""
    trace.compact = pairs
    trace.compact_ok = lambda: not nv._used
    trace.now = now
    trace.free_now = free_now
    trace.capacity = None  # the ring's (max_entries, set by _attach): older stamps go
    return trace


def _ring(device: int, maxlen: int) -> deque:
    ring = _rings.get(device)
    if ring is None or ring.maxlen != maxlen:
        ring = _rings[device] = deque(ring or (), maxlen=maxlen)  # keeps the newest
    return ring


def _appender(device: int, st: _Settings) -> Callable[[tuple], None]:
    raw = _ring(device, st.max_entries).append
    if not st.skip:
        return raw
    skip = st.skip

    def append(entry: tuple) -> None:
        if entry[0] not in skip:
            raw(entry)

    return append


def _attach(a: Any, st: _Settings) -> None:
    """Install the recorder hook of settings ``st`` in allocator ``a`` (RuntimeError if it
    cannot record)."""
    rec = _recorders.get(a)
    if rec is None:
        rec = _Recorder(a.device)
    trace = _make_trace(rec, st.level, _appender(a.device, st))
    if hasattr(trace, "compact"):
        trace.capacity = st.max_entries
    a.sync_pending()  # deferred frees happened before recording starts
    a._trace = trace  # the cudaMallocAsync allocator raises RuntimeError here
    _recorders[a] = rec


def _detach(a: Any) -> None:
    rec = _recorders.pop(a, None)
    if rec is not None:
        rec.clear()
    try:
        a.sync_pending()  # memo pairs logged as stamps are written out first
        a._trace = None
    except Exception:  # noqa: BLE001 - nothing to undo on an allocator that cannot record
        pass


def _targets() -> list:
    seen = {}
    for a in list(_alloc._active) + list(_extra):
        seen[id(a)] = a
    return list(seen.values())


def _on_new_allocator(a: Any) -> None:
    """Registry hook (``allocator._on_create``): record allocators created later too."""
    st = _settings
    if st is None:
        return
    with _lock:
        st = _settings
        if st is None:
            return
        try:
            _attach(a, st)
        except RuntimeError as exc:
            warnings.warn(f"allocation history is not recorded on device {a.device}: {exc}",
                          RuntimeWarning, stacklevel=3)


def _install_hook() -> None:
    global _hooked
    if not _hooked:
        hooks = getattr(_alloc, "_on_create", None)
        if hooks is not None and _on_new_allocator not in hooks:
            hooks.append(_on_new_allocator)
        _hooked = True


def _check_backend() -> None:
    if _alloc.allocator_config().backend == "cudaMallocAsync":
        from cudalab.allocator.async_allocator import _HISTORY_UNSUPPORTED

        raise RuntimeError(_HISTORY_UNSUPPORTED)


def _apply(st: _Settings, clear: bool) -> None:
    """Start (or re-configure) recording with settings ``st`` on every allocator."""
    global _settings
    _check_backend()
    with _lock:
        prev = _settings
        if prev is None or clear:
            _rings.clear()  # off (or retained after a with-block) -> a fresh history
        _install_hook()
        done = []
        try:
            for a in _targets():
                _attach(a, st)
                done.append(a)
        except RuntimeError:
            for a in done:
                _detach(a)
            if prev is not None:
                for a in _targets():
                    try:
                        _attach(a, prev)
                    except RuntimeError:
                        pass
            raise
        _settings = st


def _stop(clear: bool) -> None:
    """Stop recording; ``clear=False`` keeps the rings readable (end of a with-block)."""
    global _settings
    with _lock:
        _settings = None
        for a in list(_recorders.keys()) + _targets():
            _detach(a)
        if clear:
            _rings.clear()


def _validate(enabled: Any, context: Any, stacks: Any, max_entries: Any,
              skip_actions: Any) -> frozenset:
    if not (enabled is None or (isinstance(enabled, str) and enabled in _ENABLED)):
        raise ValueError(f"enabled must be one of {_choices(_ENABLED)} (or a bool for torch's "
                         f"legacy signature), got {enabled!r}")
    if not (context is None or (isinstance(context, str) and context in _CONTEXTS)):
        raise ValueError(f"context must be one of {_choices(_CONTEXTS)}, got {context!r}")
    if not (stacks is None or (isinstance(stacks, str) and stacks in _STACKS)):
        raise ValueError(f"stacks must be one of {_choices(_STACKS)}, got {stacks!r}")
    if type(max_entries) is not int or max_entries < 0:
        raise ValueError(f"max_entries must be an int >= 0, got {max_entries!r}")
    if skip_actions is None:
        return frozenset()
    if isinstance(skip_actions, str):
        skip_actions = [skip_actions]
    try:
        skip = frozenset(skip_actions)
    except TypeError:
        raise ValueError(f"skip_actions must be a list of action names, got {skip_actions!r}") \
            from None
    bad = sorted(str(s) for s in skip if s not in ACTIONS)
    if bad:
        raise ValueError(f"skip_actions: unknown action(s) {', '.join(bad)}; allowed: "
                         f"{_choices(ACTIONS)}")
    return skip


def _impl(enabled: str | None = "all", context: str | None = "all", stacks: str | None = "all",
          max_entries: int = sys.maxsize, device: Any = None, clear_history: bool = False,
          compile_context: bool = False, global_record_annotations: bool = False,
          skip_actions: Iterable[str] | None = None) -> None:
    skip = _validate(enabled, context, stacks, max_entries, skip_actions)
    if enabled is None:
        _stop(clear=True)
        return
    level = _CONTEXTS[context] if stacks is not None else _NEVER
    cap = max(1, max_entries) if enabled == "all" else 1
    _apply(_Settings(enabled, context, stacks, cap, level, skip), bool(clear_history))


def _legacy(enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
            trace_alloc_record_context: bool = False, device: Any = None,
            record_context_cpp: bool = False, clear_history: bool = False,
            compile_context: bool = False, global_record_annotations: bool = False) -> None:
    if type(trace_alloc_max_entries) is not int or trace_alloc_max_entries < 0:
        raise ValueError("trace_alloc_max_entries must be an int >= 0, got "
                         f"{trace_alloc_max_entries!r}")
    if not enabled:
        _stop(clear=True)
        return
    if trace_alloc_record_context:
        level, context = _ALLOC, "alloc"
    elif record_context:
        level, context = _STATE, "state"
    else:
        level, context = _NEVER, None
    stacks = "all" if record_context_cpp else "python"
    _apply(_Settings("all", context, stacks, max(1, trace_alloc_max_entries), level,
                     frozenset()), bool(clear_history))


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """Record the allocators' history (torch's ``torch.cuda.memory._record_memory_history``).

    ``_record_memory_history(enabled="all", context="all", stacks="all",
    max_entries=sys.maxsize, device=None, clear_history=False, compile_context=False,
    global_record_annotations=False, skip_actions=None)``; a bool ``enabled`` selects torch's
    legacy signature. See the module documentation for the meaning. Bad values raise
    ValueError and change nothing; under ``backend:cudaMallocAsync`` enabling raises
    RuntimeError, as torch's.
    """
    if isinstance(enabled, bool):
        _legacy(enabled, *args, **kwargs)
    else:
        _impl(enabled, *args, **kwargs)


class HistoryRecording:
    """What :func:`record_history` returns: recording is already on; used as a context
    manager, the previous recording state comes back on exit. If recording was off before,
    it stops, but what was recorded stays readable (``cudalab.memory._snapshot()``) until
    recording is next turned on or off."""

    __slots__ = ("_prev", "_done")

    def __init__(self, prev: _Settings | None):
        self._prev = prev
        self._done = False

    def __enter__(self) -> HistoryRecording:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.restore()
        return False

    def restore(self) -> None:
        """Put back the recording state from before (once)."""
        if self._done:
            return
        self._done = True
        if self._prev is None:
            _stop(clear=False)
        else:
            _apply(self._prev, clear=False)

    def __repr__(self) -> str:
        return f"<HistoryRecording {history_settings()!r}>"


def record_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> HistoryRecording:
    """Public alias of :func:`_record_memory_history` (same arguments); also a context
    manager that restores the previous recording state on exit::

        with cudalab.memory.record_history(max_entries=100_000):
            train_step()
        snap = cudalab.memory._snapshot()   # the step's history
    """
    with _lock:
        prev = _settings
        _record_memory_history(enabled, *args, **kwargs)
        return HistoryRecording(prev)


# --------------------------------------------------------------------------- attaching
def attach_allocator(a: Any) -> None:
    """Also record allocator ``a`` (one not made by ``get_allocator``, e.g. a private one
    over its own backend), now if recording is on and whenever it is turned on later."""
    with _lock:
        if _settings is not None:
            _attach(a, _settings)  # RuntimeError (cudaMallocAsync): nothing changed
        _extra.add(a)


def detach_allocator(a: Any) -> None:
    """Stop recording allocator ``a`` (undoes :func:`attach_allocator`)."""
    with _lock:
        _extra.discard(a)
        _detach(a)


def recorder_of(a: Any) -> _Recorder | None:
    """The recorder attached to allocator ``a`` (None when it is not recorded)."""
    return _recorders.get(a)


# --------------------------------------------------------------------------- reading
def is_recording() -> bool:
    return _settings is not None


def history_settings() -> dict | None:
    """The active settings as a dict, None when recording is off."""
    st = _settings
    if st is None:
        return None
    return {"enabled": st.enabled, "context": st.context, "stacks": st.stacks,
            "max_entries": st.max_entries, "skip_actions": sorted(st.skip)}


def devices_with_history() -> list[int]:
    """Devices that have a ring (recorded or retained), ascending."""
    return sorted(_rings)


def _sync_allocators(device: int | None = None) -> None:
    """Have the recording allocators (of ``device``, or all) write out what they deferred:
    frees queued while their lock was busy and memo pairs logged as stamps."""
    for a in list(_recorders.keys()):
        if device is None or a.device == device:
            a.sync_pending()


def nvtx_first_push() -> None:
    """cudalab.nvtx calls this before its first range: entries from now on carry a range,
    so pairs logged as stamps are written out first (and no longer logged so)."""
    if _settings is not None:
        _sync_allocators()


def raw_entries(device: int) -> list[tuple]:
    """The raw entry tuples of ``device`` (see :data:`FIELDS`), oldest to newest."""
    _sync_allocators(device)
    ring = _rings.get(device)
    if ring is None:
        return []
    for _ in range(100):
        try:
            return list(ring)
        except RuntimeError:  # appended to while copying: try again
            continue
    with _lock:
        return list(ring)


def _record_snapshot(device: int, total_active: int) -> None:
    """torch: taking a snapshot appends a ``snapshot`` entry (size = active bytes)."""
    st = _settings
    if st is None or "snapshot" in st.skip:
        return
    m = _nvtx_tls.__dict__.get("messages") if _nvtx_flag()._used else None
    _ring(device, st.max_entries).append(
        ("snapshot", 0, total_active, 0, time.time_ns(), None, m[-1] if m else None, _cell))


def entry_to_dict(e: tuple, device: int, cache: dict | None = None) -> dict:
    """One raw entry as torch's trace entry dict plus cudalab's device/nvtx_range/cell."""
    action = e[0]
    return {
        "action": action,
        "device_free" if action == "oom" else "addr": e[1],
        "size": e[2],
        "stream": e[3],
        "time_us": e[4] // 1000,
        "frames": frames_to_dicts(e[5], cache),
        "compile_context": "",
        "user_metadata": "",
        "device": device,
        "nvtx_range": e[6],
        "cell": e[7],
    }


def trace_entries(device: int, cache: dict | None = None) -> list[dict]:
    """The trace of ``device`` as torch-schema dicts, oldest to newest."""
    if cache is None:
        cache = {}
    return [entry_to_dict(e, device, cache) for e in raw_entries(device)]
