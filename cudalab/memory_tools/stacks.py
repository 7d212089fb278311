"""Stack capture for the allocation history: which Python frames allocated or freed a block.

The history recorder (:mod:`cudalab.memory_tools.history`) asks this module for the stack of
the user code calling an allocator method. Stacks are walked with ``sys._getframe`` and
stored as flat tuples ``(code, lasti, code, lasti, ...)``, innermost first; cudalab's own
frames (found by module name on Python 3.12+, by file before) are left out. Lines are
computed from ``lasti`` only when a snapshot is taken (:func:`frames_to_dicts`).

A running frame's stack at a given instruction cannot change until it returns, so each frame
caches its stacks on itself (a small object, :class:`_Mark`, set as its ``f_trace``, gone
with the frame): the walk stops at the first frame that knows the rest (a notebook cell's
~25 kernel frames are walked once per cell, a loop's allocations once per call site), and
the entries of a loop share one stack tuple. Generator and coroutine frames are not cached,
nothing is cached while a trace function (a debugger, coverage) is set, and a frame's own
``f_trace`` is never replaced.

Three entry points, one stack:

* :func:`capture_stack` ``(d)``: the general walk, used by the history's trace hook.
* ``_stamp()``: the memo's stamp ``(time, stack)`` of an allocation or free, its common case
  written out (benchmark row ``stacks="python"`` of ``benchmarks/history.py``).
* its C twin ``cudalab.memory_tools._stackstamp.stamp`` (CPython 3.11-3.13, built optionally
  at install; ``CUDALAB_PURE_PYTHON=1`` turns it off): it reads the interpreter's frames
  instead of making frame objects for cudalab's own, for the same stacks at less than half
  the cost. It reads this module's state (:data:`_cud_mods`, :data:`_other_mods`,
  :data:`_internal`, :class:`_Mark`) by reference, given once through its ``setup()``, and
  falls back to :func:`capture_stack`. ``tests/memory_tools/test_stackstamp.py`` pins the two
  stamps together, so they cannot drift, and every history test runs with both.

:func:`stamp_implementation` says which stamp is used.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, TypeAlias, TypedDict

__all__ = [
    "FrameCache",
    "FrameDict",
    "Stack",
    "Stamp",
    "active_stamp",
    "capture_stack",
    "frames_to_dicts",
    "line_of",
    "stamp_implementation",
]

#: A captured Python stack: flat, innermost first, ``(code, lasti, code, lasti, ...)`` (code
#: objects at even indices, instruction offsets at odd ones); () when all of it is cudalab's.
Stack: TypeAlias = tuple[Any, ...]
#: A memo stamp with a stack: ``(time_ns, stack)``.
Stamp: TypeAlias = tuple[int, Stack]
#: :func:`frames_to_dicts`' cache, shared by the conversions of one snapshot: keys are
#: ``id(stack)``, ``(id(code), lasti)`` and ``("code", id(code))``; values the converted
#: ``(stack, frame dicts)``, a :class:`FrameDict` and the code kept alive.
FrameCache: TypeAlias = dict[Hashable, Any]


class FrameDict(TypedDict):
    """One frame of a stack as torch's snapshots write it."""

    filename: str
    line: int
    name: str

_getframe: Callable[[int], Any] = sys._getframe  # (frames typed Any: f_back may be None)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: co_filename -> inside the cudalab package (Python 3.11's way to tell cudalab's frames).
#: Invariant, as for _cud_mods and _other_mods below: shared by reference with the compiled
#: stamp (given to _stackstamp.setup() once), so it is filled in place and never rebound.
_internal: dict[str, bool] = {}


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
_modname: Any = getattr(sys, "_getframemodulename", None)  # Python 3.12+
_now = time.time_ns
# Names of the modules whose frames are on captured stacks, by whether they are cudalab's
# (None, a frame without a module name or beyond the stack, is in neither). Shared by
# reference with the compiled stamp: filled in place, never rebound.
_cud_mods: set[str | None] = set()
_other_mods: set[str | None] = set()


_MARK_MAX = 256  # entries one mark keeps (a frame calling ever new code objects)


class _Mark(dict[Hashable, Any]):
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


def capture_stack(d: int) -> Stack:
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


#: The stack of the caller's first frame outside cudalab, outwards (``capture_stack(0)``),
#: as :func:`capture_stack` makes it: the public name for other tools (the stream sanitizer).
capture_stack = capture_stack

#: The module whose functions are torch.cuda.memory's: torch writes those in Python, so
#: torch's stacks show their frames (``empty_cache`` on a ``segment_free``, say).
_API_MODULES = frozenset({"cudalab.memory", "cudalab.memory_control"})  # (memory re-exports the second)


def capture_from_api(d: int) -> Stack:
    """:func:`capture_stack`'s stack, preceded by the frame of the :mod:`cudalab.memory` function
    the user called (or of :mod:`cudalab.memory_control`, whose functions it re-exports),
    when one is on the stack (its outermost one); the frames inside it are
    dropped as :func:`capture_stack` drops them.

    torch's stacks keep the frames of its Python API (``torch.cuda.memory.empty_cache``,
    ``caching_allocator_delete``), so a free's stack in memory_viz shows what released the
    memory. Used for the stacks of frees (context ``"all"``), which are not on the hot path.
    """
    d += 1  # this frame
    try:
        f = _getframe(d)
    except ValueError:
        return ()
    api = None
    internal = _internal
    while f is not None:
        fn = f.f_code.co_filename
        flag = internal.get(fn)
        if flag is None:
            flag = internal[fn] = _is_internal(fn)
        if not flag:
            break
        if f.f_globals.get("__name__") in _API_MODULES:
            api = f  # the outermost one wins
        f = f.f_back
    rest: Stack = ()
    if f is not None:
        li = f.f_lasti
        m = f.f_trace
        cached = m.get(li) if type(m) is _Mark else None
        rest = cached if cached is not None else _miss(f, li, m)
    if api is None:
        return rest
    return _shared((api.f_code, api.f_lasti) + rest)


# The memo's stamp. Hot path (benchmarks/history.py row stacks="python"): one call per memo
# hit while recording with stacks, so its common case is written out here rather than
# calling capture_stack. Its C twin, _stackstamp.c's stamp(), is the only other fast copy;
# tests/memory_tools/test_stackstamp.py pins the two together so they cannot drift.
if _modname is not None:
    def _stamp() -> Stamp:
        """The memo's stamp of an allocation (or of a free, when frees carry their own
        stack): ``(time, stack)``, the stack as ``capture_stack(2)`` makes it. The allocator
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
        except TypeError:  # an unhashable module name: capture_stack copes
            pass
        return _now(), capture_stack(2)
else:
    def _stamp() -> Stamp:
        """The memo's stamp of an allocation (or of a free, when frees carry their own
        stack): ``(time, stack)``. The allocator method calls it directly."""
        return _now(), capture_stack(2)


_py_stamp = _stamp


def _pure_python_requested() -> bool:
    """Whether ``CUDALAB_PURE_PYTHON`` asks for the pure-Python stamp (unset, empty or 0:
    no; setup.py reads it the same way, to skip building the compiled one)."""
    return os.environ.get("CUDALAB_PURE_PYTHON", "0") not in ("", "0")


def _load_compiled_stamp() -> Callable[[], Stamp] | None:
    """``cudalab.memory_tools._stackstamp.stamp`` set up over this module's state, or None where
    it is not built (another Python, no compiler at install time; see setup.py) or
    ``CUDALAB_PURE_PYTHON`` is set. It is ``_stamp`` in C over CPython's interpreter frames:
    the same stacks at less than half the cost. A module that is there but does not fit (built
    from other sources) is reported and left unused."""
    if _pure_python_requested():
        return None
    try:
        from cudalab.memory_tools import _stackstamp  # type: ignore[attr-defined]  # C, no stub
    except ImportError:
        return None
    try:
        api = getattr(_stackstamp, "API", None)
        if api != 2:
            raise TypeError(f"API {api!r}, expected 2")
        # The objects are shared, not copied: they are filled in place and never rebound.
        _stackstamp.setup(_cud_mods, _other_mods, _internal, _Mark, capture_stack)
    except Exception as exc:  # noqa: BLE001  (a stale build must not break recording)
        warnings.warn(f"cudalab.memory_tools._stackstamp ({_stackstamp.__file__}) is not usable, "
                      f"using the pure-Python stamp: {exc}. Reinstall cudalab to rebuild it.",
                      RuntimeWarning, stacklevel=2)
        return None
    return _stackstamp.stamp


_c_stamp = _load_compiled_stamp()
if _c_stamp is not None:
    _stamp = _c_stamp

#: Kinds of stamp function of a compiled HitLog (_stackstamp.c's HIT_CLOCK, HIT_STAMP,
#: HIT_CALL: so the two cannot drift, tests/memory_tools/test_stackstamp.py checks them).
_HIT_CLOCK, _HIT_STAMP, _HIT_CALL = 0, 1, 2
#: A log this long counts as unbounded (the compiled log's own limit is 2**61 - 1).
_UNBOUNDED = 1 << 60


def hit_log(maxlen: int | None, now: Callable[[], Any]) -> Any:
    """The caching allocator's log of memo stamps for one recording (the protocol's
    ``CompactTrace.new_log``): bounded to the newest ``maxlen`` stamps (None: unbounded).

    With the compiled stamp in use it is ``_stackstamp.HitLog``, whose ``hit(tfree)`` logs a
    pure memo hit's two stamps (its free's, then ``now()``'s) in one call from the allocator's
    hot path (benchmarks/history.py, the rows once the ring holds N entries); otherwise a
    ``collections.deque`` (the allocator then appends the two stamps itself). Both iterate
    oldest first and have ``append``, ``clear`` and ``len``.

    Parameters
    ----------
    maxlen : int or None
        The most stamps kept (even, as stamps come in pairs), None for no bound.
    now : callable
        The stamp of a hit: ``time.time_ns`` or the active stack stamp.
    """
    if _c_stamp is None or _stamp is not _c_stamp:
        return deque(maxlen=maxlen)
    from cudalab.memory_tools import _stackstamp  # type: ignore[attr-defined]  # C, no stub

    kind = _HIT_CLOCK if now is time.time_ns else _HIT_STAMP if now is _c_stamp else _HIT_CALL
    bound = _UNBOUNDED if maxlen is None or maxlen >= _UNBOUNDED else maxlen + (maxlen & 1)
    return _stackstamp.HitLog(bound, now, kind)


def active_stamp() -> Callable[[], Stamp]:
    """The stamp that recordings started now use: ``_stamp`` (the compiled one where it is
    built, see :func:`stamp_implementation`). The history reads it when it attaches to an
    allocator, so :func:`_use_stamp` affects the recordings started after it."""
    return _stamp


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


def _miss(f: Any, li: int, m: Any) -> Stack:
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


def _walk(f0: Any, li0: int) -> Stack:
    """The stack from frame ``f0`` (at ``li0``) outwards, up to the first frame whose mark
    knows the rest, marking the frames walked."""
    walked: list[Any] = [f0, li0]  # frames without a cached stack, innermost first, with lasti
    ap = walked.append
    f = f0.f_back
    t: Stack = ()
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
_sites: dict[tuple[int, int], Stack] = {}


def _shared(t: Stack) -> Stack:
    key = (id(t[0]), t[1])
    prev = _sites.get(key)
    if prev == t:  # element identity first: cheap for equal stacks
        return prev
    if len(_sites) >= 8192:
        _sites.clear()
    _sites[key] = t
    return t


def line_of(code: Any, lasti: int) -> int:
    """The source line of ``code`` at instruction offset ``lasti`` (its first line when the
    offset has none)."""
    if lasti >= 0:
        for start, end, line in code.co_lines():
            if start <= lasti < end:
                return line if line is not None else code.co_firstlineno
    return code.co_firstlineno


def frames_to_dicts(frames: Stack | None, cache: FrameCache | None = None) -> list[FrameDict]:
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
    out: list[FrameDict] = []
    for i in range(0, len(frames), 2):
        code = frames[i]
        lasti = frames[i + 1]
        fkey = (id(code), lasti)
        d: FrameDict | None = cache.get(fkey)
        if d is None:
            made: FrameDict = {"filename": code.co_filename, "line": line_of(code, lasti),
                               "name": code.co_name}
            d = cache[fkey] = made
            cache[("code", id(code))] = code  # keep the code alive while the cache is used
        out.append(d)
    cache[key] = (frames, out)
    return out
