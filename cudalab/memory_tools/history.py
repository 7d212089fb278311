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
  live block for snapshots only (segments keep none, so freed memory shows no allocating
  stack, as torch's); ``"alloc"``: also attached to the alloc trace entries and to the
  segments (free entries then carry the allocation's stack, as torch's); ``"all"``: free
  entries carry the stack of the code that freed.
* ``stacks``: ``"python"`` or ``"all"``. cudalab has no C++ frames, so both capture the same
  Python frames (cudalab's own frames are left out, except that a free's stack starts at
  the :mod:`cudalab.memory` function called, such as ``empty_cache``, whose frame torch's
  stacks show because torch writes that API in Python). ``None`` (a cudalab extension) captures
  no stack at all, whatever ``context`` says.
* ``max_entries``: size of the per-device ring buffer; once full the oldest entry is
  overwritten. Entries read back oldest to newest.
* ``clear_history=True`` drops what was recorded so far; ``skip_actions`` (newer torch) lists
  actions not to record; ``device``, ``compile_context`` and ``global_record_annotations``
  are accepted for torch compatibility and ignored.

Entries are recorded as tuples ``(action, addr, size, stream, time_ns, frames,
nvtx_range, cell)`` (see :data:`FIELDS`) into one ring per device, a
:class:`~cudalab.memory_tools.history_ring.HistoryRing`, which moves them into columns of
machine integers every few thousand entries (no Python object per stored entry, nothing
for the garbage collector to traverse) and rebuilds the tuples when they are read;
``frames`` is None or a flat tuple ``(code, lasti, code, lasti, ...)`` innermost first,
turned into ``{"filename", "line", "name"}`` dicts only when a snapshot is taken
(:func:`cudalab.memory_tools.stacks.frames_to_dicts`). For an ``oom`` entry ``addr`` holds
the bytes free on the device.
``nvtx_range`` is the innermost open :mod:`cudalab.nvtx` range of the thread, ``cell`` the
notebook cell id set with :func:`set_current_cell`. An entry recorded while user metadata
is set (:func:`_set_memory_metadata`) has a ninth element, the metadata string (torch's
``user_metadata``); without metadata, entries are built exactly as before.

Stacks are captured by :mod:`cudalab.memory_tools.stacks` (cached on the running frames,
cudalab's own frames left out; the memo's stamp has a C twin there). Memo pairs (a loop
allocating and freeing one size) are logged by the allocator as stamps (time, stack) and
written out as entries before anything reads the history.

The recorder talks to the allocators only through the trace hook protocol of
:mod:`cudalab.allocator.hooks`: its hook is a :class:`~cudalab.allocator.hooks.CompactTrace`,
attached with :func:`~cudalab.allocator.hooks.attach_trace`; allocators created later are
found through :func:`cudalab.allocator.registry.add_create_hook`. :func:`stop_recording`
turns recording off.

As torch: ``enabled="state"`` with the default ``context="all"`` still captures a stack at
each free (kept nowhere but torch does the same); taking a snapshot (``_snapshot()`` and
``memory_snapshot()``) appends a ``snapshot`` entry per device while recording, after the
snapshot's own trace was read (so that trace ends with the last allocator event).

Differences from torch: turning recording off also forgets the stacks of live blocks (torch
keeps them on its blocks until they are freed); the pluggable allocator records too (torch's
raises); :class:`HistoryRecording` (the context manager) leaves what it recorded readable
after the block when recording was off before it.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import CodeType, ModuleType
from typing import Any, Literal, NamedTuple

from cudalab import nvtx as _nvtx
from cudalab.allocator import hooks as _hooks
from cudalab.allocator import registry as _registry
from cudalab.allocator.async_allocator import HISTORY_UNSUPPORTED
from cudalab.allocator.hooks import CompactTrace
from cudalab.memory_tools import history_pools as _history_pools
from cudalab.memory_tools import stacks as _stacks
from cudalab.memory_tools.history_ring import ACTIONS, CHUNK, HistoryRing, TraceEntry
from cudalab.memory_tools.stacks import FrameCache, Stack
from cudalab.nvtx import thread_ranges as _nvtx_ranges  # never rebound: bound once (hot)

__all__ = [
    "ACTIONS",
    "FIELDS",
    "HistoryRecording",
    "_get_memory_metadata",
    "_record_memory_history",
    "_set_memory_metadata",
    "attach_allocator",
    "current_cell",
    "detach_allocator",
    "devices_with_history",
    "history_settings",
    "is_recording",
    "entry_count",
    "raw_entries",
    "record_history",
    "set_current_cell",
    "stop_recording",
    "trace_entries",
]

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


# --------------------------------------------------------------------------- user metadata
#: torch's user metadata: the string recorded on new entries ("" for none). It is bound into
#: each recorder's appender when the recorder is attached (_appender), so setting it
#: re-attaches the recorders; reading it costs the recording path nothing.
_metadata = ""


def _set_memory_metadata(metadata: str) -> None:
    """Record ``metadata`` on the history entries from now on (torch's
    ``torch.cuda.memory._set_memory_metadata``).

    Entries recorded while it is set carry it as ``user_metadata`` in snapshots
    (``cudalab.memory._snapshot()``) and exports; it has no effect while history is not
    recorded, and it is not shown on segments or blocks. It applies to every device and
    thread (torch 2.11 keeps one value per allocator too; newer torch keeps one per
    thread), and to every cudalab allocator that records history.

    Parameters
    ----------
    metadata : str
        The string; ``""`` clears it.

    Raises
    ------
    TypeError
        When ``metadata`` is not a str.
    """
    global _metadata
    if not isinstance(metadata, str):
        raise TypeError(f"metadata must be a str, got {type(metadata).__name__} {metadata!r}")
    with _lock:
        if metadata == _metadata:
            return
        st = _settings
        if st is not None:
            _sync_allocators()  # deferred entries (memo pairs) carry the old metadata
        _metadata = metadata
        if st is not None:
            for a in _targets():
                try:
                    _attach(a, st)
                except RuntimeError:  # an allocator that cannot record: nothing to do
                    pass


def _get_memory_metadata() -> str:
    """The metadata set by :func:`_set_memory_metadata` (torch's
    ``_get_memory_metadata``).

    Returns
    -------
    str
        ``""`` when none is set.
    """
    return _metadata


# --------------------------------------------------------------------------- state
class _Settings(NamedTuple):
    """One recording configuration."""

    enabled: str
    context: str | None
    stacks: str | None
    max_entries: int
    level: int
    skip: frozenset[str]


class _Recorder:
    """Per-allocator bookkeeping: stacks of live blocks and segments, hand-over state."""

    __slots__ = ("device", "blocks", "segs", "pending", "last_free", "__weakref__")

    def __init__(self, device: int):
        self.device = device
        self.blocks: dict[int, Stack | None] = {}  # live block address -> frames at allocation
        self.segs: dict[int, Stack | None] = {}  # segment address -> frames at creation
        #: (thread, frames) of a segment_alloc for its alloc
        self.pending: tuple[int, Stack] | None = None
        #: (addr, frames, id of the freeing frame, its code) of the last free_requested
        self.last_free: tuple[int, Stack, int, CodeType] | None = None

    def clear(self) -> None:
        self.blocks.clear()
        self.segs.clear()
        self.pending = self.last_free = None


_lock = threading.RLock()
_settings: _Settings | None = None
_rings: dict[int, HistoryRing] = {}
# allocator -> _Recorder
_recorders: weakref.WeakKeyDictionary[Any, _Recorder] = weakref.WeakKeyDictionary()
_extra: weakref.WeakSet[Any] = weakref.WeakSet()  # allocators attached by attach_allocator()
_hooked = False


def _make_trace(rec: _Recorder, level: int, append: Callable[[TraceEntry], None],
                ring: HistoryRing | None = None) -> CompactTrace:
    """The allocator hook ``trace(action, addr, size, stream)`` for one recorder, passing
    its entries to ``append``. With ``ring`` (whose ``young`` list ``append`` fills), the
    hook has the ring compact its young entries each time they reach a chunk."""
    now = time.time_ns
    # the ring's young entries, and when to compact them (never, without a ring)
    young: list[TraceEntry] = ring.young if ring is not None else []
    compact = ring.compact if ring is not None else _no_compact
    full = CHUNK if ring is not None else sys.maxsize
    nvtls = _nvtx_ranges
    nv = _nvtx  # nv.ranges_used: one attribute load per entry (the flag is rebound once)

    if level == _NEVER:
        def trace_times(action: str, addr: int, size: int, stream: int) -> None:
            m = nvtls.__dict__.get("messages") if nv.ranges_used else None
            append((action, addr, size, stream, now(), None, m[-1] if m else None, _cell))
            if len(young) >= full:
                compact()

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
                if len(young) >= full:
                    compact()

        # Entries without stacks carry nothing but the time: the memo's stamps are times.
        return _compact(trace_times, pairs, now, now, nv)

    blocks = rec.blocks
    segs = rec.segs
    cap = _stacks.capture_stack
    cap_api = _stacks.capture_from_api  # frees' stacks keep the API frame, as torch's
    getframe = sys._getframe
    ident = threading.get_ident
    on_alloc = level >= _ALLOC
    on_free = level == _ALL

    def trace(action: str, addr: int, size: int, stream: int) -> None:  # noqa: C901
        # called by an allocator method: cap(2) starts at that method's caller
        fr: Stack | None  # (a local's annotation: no code)
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
                fr = cap_api(2)
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
            # torch keeps a segment's stack only from context "alloc" up ("state" keeps
            # the stacks of live blocks only: freed memory shows no allocating frames)
            if on_alloc and addr not in segs:
                segs[addr] = fr
            ef = fr if on_alloc else None
        elif action == "segment_free" or action == "segment_unmap":
            fr = segs.pop(addr, None)
            if on_free:
                fr = cap_api(2)
            ef = fr if on_alloc else None
        elif action == "oom":
            p = rec.pending
            rec.pending = None
            fr = p[1] if p is not None and p[0] == ident() else cap(2)
            ef = fr if on_alloc else None
        else:
            ef = None
        m = nvtls.__dict__.get("messages") if nv.ranges_used else None
        append((action, addr, size, stream, now(), ef, m[-1] if m else None, _cell))
        if len(young) >= full:
            compact()

    # Memo pairs are logged compactly too (see _compact): their stamps are (time, stack)
    # for an allocation, and for a free when frees carry their own stack (context "all"),
    # else the time. The allocator method calls the stamp (stacks._stamp, or its compiled
    # twin) directly.

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
            if len(young) >= full:
                compact()

    stamp = _stacks.active_stamp()
    return _compact(trace, pairs_with_stacks, stamp, stamp if on_free else now, nv)


def _compact(trace: Any, pairs: Callable[[int, int, int, Any], None], now: Callable[[], Any],
             free_now: Callable[[], Any], nv: ModuleType) -> CompactTrace:
    """``trace`` as a :class:`~cudalab.allocator.hooks.CompactTrace`: with what the allocator
    needs to log memo pairs compactly. ``now()`` and ``free_now()`` make the alloc and free
    stamps, ``pairs(addr, size, stream, stamps)`` writes them out as entries. That is
    possible as long as no NVTX range was ever pushed and the cell stays the same
    (set_current_cell and the first NVTX push flush the allocators first), since entries
    then carry nothing else.

    The hook stays a plain function with these attributes (not an instance of a class with
    ``__call__``): the allocator calls it on every operation, and a bound ``__call__`` would
    add a call level there (benchmarks/history.py, history added cost rows).
    ``tests/memory_tools/test_history.py`` checks it against the protocol's fields."""
    trace.compact = pairs
    trace.compact_ok = lambda: not nv.ranges_used
    trace.now = now
    trace.free_now = free_now
    trace.capacity = None  # the ring's (max_entries, set by _attach): older stamps go
    trace.new_log = lambda maxlen: _stacks.hit_log(maxlen, now)
    return trace  # a function given the protocol's fields


def _no_compact() -> None:
    """The compaction of a hook without a ring (tests hand ``_make_trace`` a list)."""


def _ring(device: int, maxlen: int) -> HistoryRing:
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = HistoryRing(maxlen)
    elif ring.maxlen != maxlen:
        ring.set_maxlen(maxlen)  # keeps the newest
    return ring


def _appender(ring: HistoryRing, st: _Settings) -> Callable[[TraceEntry], None]:
    raw = ring.young.append
    meta = _metadata
    if meta:  # (only while metadata is set: the plain path appends the tuple as built)
        ring_append = raw

        def raw(entry: TraceEntry) -> None:
            ring_append((*entry, meta))

    if not st.skip:
        return raw
    skip = st.skip
    put = raw

    def append(entry: TraceEntry) -> None:
        if entry[0] not in skip:
            put(entry)

    return append


def _attach(a: Any, st: _Settings) -> None:
    """Install the recorder hook of settings ``st`` in allocator ``a`` (RuntimeError if it
    cannot record)."""
    rec = _recorders.get(a)
    if rec is None:
        rec = _Recorder(a.device)
    ring = _ring(a.device, st.max_entries)
    trace = _make_trace(rec, st.level, _appender(ring, st), ring)
    trace.capacity = st.max_entries
    trace.pool_segment = _history_pools.hook(a.device)  # type: ignore[attr-defined]  # PoolTrace
    _history_pools.seed(a)
    # deferred frees happened before recording starts: attach_trace applies them first; the
    # cudaMallocAsync allocator raises RuntimeError here
    _hooks.attach_trace(a, trace)
    _recorders[a] = rec


def _detach(a: Any) -> None:
    rec = _recorders.pop(a, None)
    if rec is not None:
        rec.clear()
    try:
        _hooks.detach_trace(a)  # memo pairs logged as stamps are written out first
    except Exception:  # noqa: BLE001 - nothing to undo on an allocator that cannot record
        pass


def _targets() -> list[Any]:
    seen: dict[int, Any] = {}
    for a in list(_registry.active) + list(_extra):
        seen[id(a)] = a
    return list(seen.values())


def _on_new_allocator(a: Any) -> None:
    """Registry create hook (:func:`cudalab.allocator.registry.add_create_hook`): record
    allocators created later too. Called with the registry's lock held: it takes this
    module's lock, so this module never asks the registry for its lock while holding its own
    (:func:`_install_hook` runs before ``_lock`` is taken)."""
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
        _registry.add_create_hook(_on_new_allocator)  # (once, however often it is added)
        _hooked = True


def _check_backend() -> None:
    if _registry.allocator_config().backend == "cudaMallocAsync":
        raise RuntimeError(HISTORY_UNSUPPORTED)


def _apply(st: _Settings, clear: bool) -> None:
    """Start (or re-configure) recording with settings ``st`` on every allocator."""
    global _settings
    _check_backend()
    _install_hook()  # (outside _lock: see _on_new_allocator)
    with _lock:
        prev = _settings
        if prev is None or clear:
            _rings.clear()  # off (or retained after a with-block) -> a fresh history
            _history_pools.clear()
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


def stop_recording(clear: bool = True) -> None:
    """Stop recording on every allocator.

    Parameters
    ----------
    clear : bool, optional
        True (default, as ``_record_memory_history(None)``) drops what was recorded; False
        keeps the rings readable (``cudalab.memory._snapshot()``, :func:`raw_entries`) until
        recording is next turned on or off, as the end of a :class:`HistoryRecording` does.
    """
    global _settings
    with _lock:
        _settings = None
        for a in list(_recorders.keys()) + _targets():
            _detach(a)
        if clear:
            _rings.clear()
            _history_pools.clear()


def _validate(enabled: Any, context: Any, stacks: Any, max_entries: Any,
              skip_actions: Any) -> frozenset[str]:
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
        stop_recording(clear=True)
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
        stop_recording(clear=True)
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

    def __exit__(self, *exc: Any) -> Literal[False]:
        self.restore()
        return False

    def restore(self) -> None:
        """Put back the recording state from before (once)."""
        if self._done:
            return
        self._done = True
        if self._prev is None:
            stop_recording(clear=False)
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
    """Whether history is being recorded now."""
    return _settings is not None


def history_settings() -> dict[str, Any] | None:
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


def raw_entries(device: int) -> list[TraceEntry]:
    """The raw entry tuples of ``device`` (see :data:`FIELDS`), oldest to newest."""
    _sync_allocators(device)
    ring = _rings.get(device)
    if ring is None:
        return []
    return ring.entries()


def entry_count(device: int) -> int:
    """How many entries the history of ``device`` holds now (no copy is made)."""
    ring = _rings.get(device)
    return 0 if ring is None else len(ring)


def record_snapshot(device: int, total_active: int) -> None:
    """torch: taking a snapshot appends a ``snapshot`` entry (size = active bytes)."""
    st = _settings
    if st is None or "snapshot" in st.skip:
        return
    m = _nvtx_ranges.__dict__.get("messages") if _nvtx.ranges_used else None
    entry: TraceEntry = ("snapshot", 0, total_active, 0, time.time_ns(), None, m[-1] if m else None,
                    _cell)
    if _metadata:
        entry = (*entry, _metadata)
    _ring(device, st.max_entries).append(entry)


def entry_to_dict(e: TraceEntry, device: int, cache: FrameCache | None = None
                  ) -> dict[str, Any]:
    """One raw entry as torch's trace entry dict plus cudalab's device/nvtx_range/cell."""
    action = e[0]
    return {
        "action": action,
        "device_free" if action == "oom" else "addr": e[1],
        "size": e[2],
        "stream": e[3],
        "time_us": e[4] // 1000,
        "frames": _stacks.frames_to_dicts(e[5], cache),
        "compile_context": "",
        "user_metadata": e[8] if len(e) > 8 else "",
        "device": device,
        "nvtx_range": e[6],
        "cell": e[7],
    }


def trace_entries(device: int, cache: FrameCache | None = None) -> list[dict[str, Any]]:
    """The trace of ``device`` as torch-schema dicts, oldest to newest."""
    if cache is None:
        cache = {}
    raw = raw_entries(device)
    out = [entry_to_dict(e, device, cache) for e in raw]
    _history_pools.tag(device, raw, out)  # segment_pool_id of private-pool entries
    return out
