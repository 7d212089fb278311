"""The memo's stamp and its compiled twin, ``cudalab.memory_tools._stackstamp``: the same stacks
whichever is used (the history tests run with each as well, see test_history.STAMPS), a
build wherever one can be made, and a stale or refused build that breaks nothing."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudalab.memory_tools import stacks

HERE = os.path.abspath(__file__)


def line() -> int:
    """The caller's current line."""
    return sys._getframe(1).f_lineno


def top(frames) -> tuple:
    f = frames[0]
    return (f["filename"], f["line"], f["name"])


def _allocator_method(stamp, *args):
    """Stands for the allocator method that calls the stamp: the stamp skips it."""
    return stamp(*args)


def _name() -> str:
    """The caller's function name."""
    return sys._getframe(1).f_code.co_name


needs_compiled = pytest.mark.skipif(stacks._c_stamp is None,
                                    reason="cudalab.memory_tools._stackstamp is not built here (or CUDALAB_PURE_PYTHON is set)")


@needs_compiled
@pytest.mark.parametrize("first", ["python", "compiled"])
def test_the_compiled_stamp_gives_the_python_stamps_stacks(first):
    """At one place of one frame both stamps give one stack object, whichever walks first
    (the compiled one then takes stacks.capture_stack's path, from the right depth), and it is
    the real stack; at a new instruction too."""
    stamps = {"python": stacks._py_stamp, "compiled": stacks._c_stamp}
    order = [stamps[first], stamps["python" if first == "compiled" else "compiled"]]

    def place():
        got, again = [], []
        for s in order:
            got.append(_allocator_method(s)); ln = line()  # noqa: E702
        for s in order[::-1]:
            again.append(_allocator_method(s)); ln2 = line()  # noqa: E702
        return got, ln, again, ln2

    t0 = time.time_ns()
    got, ln, again, ln2 = place()
    for (t, stack), ln_ in [(got[0], ln), (got[1], ln), (again[0], ln2), (again[1], ln2)]:
        assert t0 <= t <= time.time_ns()
        fr = stacks.frames_to_dicts(stack)
        assert top(fr)[1:] == (ln_, "place") and fr[0]["filename"] == HERE
        real = traceback.extract_stack()
        assert [(f["filename"], f["name"]) for f in fr[1:]] == [
            (f.filename, f.name) for f in reversed(real)]
    assert got[0][1] is got[1][1] and again[0][1] is again[1][1]
    assert got[0][1] != again[0][1]
    # the compiled stamps (one from _capture's path, one from a mark) are left out of the
    # collector's work: they cannot be part of a cycle
    compiled = [got[0], again[1]] if first == "compiled" else [got[1], again[0]]
    assert not any(gc.is_tracked(c) for c in compiled)


@needs_compiled
def test_the_compiled_stamp_from_a_bare_thread_and_under_a_tracer():
    """A thread's outermost frame, and frames a trace function owns (no mark): the compiled
    stamp falls back to stacks.capture_stack and still gives the real stack."""
    out = []

    def body():
        out.append((stacks.frames_to_dicts(_allocator_method(stacks._c_stamp)[1]), line()))

    th = threading.Thread(target=body)
    th.start()
    th.join()
    fr, ln = out[0]
    assert top(fr) == (HERE, ln, "body")
    assert fr[-1]["filename"] == threading.__file__

    def tracer(frame, event, arg):
        return tracer

    sys.settrace(tracer)
    try:
        st, ln = _allocator_method(stacks._c_stamp)[1], line()
    finally:
        sys.settrace(None)
    assert top(stacks.frames_to_dicts(st)) == (
        HERE, ln, "test_the_compiled_stamp_from_a_bare_thread_and_under_a_tracer")


def test_the_compiled_stamp_is_built_where_it_can_be():
    """An install on CPython 3.11-3.13 (GIL build) with a C compiler and Python's headers
    builds the compiled stamp (setup.py); elsewhere the pure-Python one is used, silently."""
    import shutil
    import sysconfig

    if (sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13)
            or sysconfig.get_config_var("Py_GIL_DISABLED")):
        assert stacks._c_stamp is None
        pytest.skip("the compiled stamp is for CPython 3.11-3.13 with the GIL")
    if stacks._pure_python_requested():
        assert stacks._c_stamp is None and stacks.stamp_implementation() == "python"
        return
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.join(sysconfig.get_paths()["include"], "internal", "pycore_frame.h")
    if shutil.which(cc) is None or not os.path.exists(headers):
        pytest.skip(f"no C compiler ({cc}) or no CPython headers here")
    assert stacks._c_stamp is not None, (
        "cudalab.memory_tools._stackstamp was not built: reinstall cudalab (pip install -e .) or "
        "run python setup.py build_ext --inplace")
    assert stacks.stamp_implementation() == "compiled"  # (the default where it is built)


def test_choosing_a_stamp_checks_its_name(monkeypatch):
    with pytest.raises(ValueError, match="'python' or 'compiled'"):
        stacks._use_stamp("fast")
    before = stacks.stamp_implementation()
    monkeypatch.setattr(stacks, "_c_stamp", None)
    with pytest.raises(RuntimeError, match="not built"):
        stacks._use_stamp("compiled")
    monkeypatch.undo()
    assert stacks.stamp_implementation() == before


class _FakeStackstamp:
    """A stand-in for a build of cudalab.memory_tools._stackstamp."""

    __file__ = "/somewhere/_stackstamp.so"

    def __init__(self, api=2, fail=None):
        self.API = api
        self.fail = fail
        self.given = None

    def setup(self, *args):
        if self.fail:
            raise self.fail
        self.given = args

    def stamp(self):
        raise AssertionError("not called here")


@pytest.mark.parametrize("fake", [_FakeStackstamp(api=1), _FakeStackstamp(api=None),
                                  _FakeStackstamp(fail=TypeError("setup() takes 4 arguments"))],
                         ids=["old API", "no API", "setup fails"])
def test_a_stale_compiled_stamp_is_reported_and_not_used(fake, monkeypatch):
    """A _stackstamp built from other sources (an old in-place build) must not break
    importing or recording: it is reported once and the Python stamp is used."""
    import cudalab.memory_tools as M

    monkeypatch.delenv("CUDALAB_PURE_PYTHON", raising=False)
    monkeypatch.setitem(sys.modules, "cudalab.memory_tools._stackstamp", fake)
    monkeypatch.setattr(M, "_stackstamp", fake, raising=False)
    with pytest.warns(RuntimeWarning, match="not usable, using the pure-Python stamp"):
        assert stacks._load_compiled_stamp() is None


def test_a_fitting_compiled_stamp_gets_the_shared_state_and_the_switch_turns_it_off(
        monkeypatch):
    import cudalab.memory_tools as M

    fake = _FakeStackstamp()
    monkeypatch.setitem(sys.modules, "cudalab.memory_tools._stackstamp", fake)
    monkeypatch.setattr(M, "_stackstamp", fake, raising=False)
    monkeypatch.delenv("CUDALAB_PURE_PYTHON", raising=False)
    assert stacks._load_compiled_stamp() == fake.stamp
    assert fake.given == (stacks._cud_mods, stacks._other_mods, stacks._internal,
                          stacks._Mark, stacks.capture_stack)
    assert all(a is b for a, b in zip(fake.given, (stacks._cud_mods, stacks._other_mods)))
    monkeypatch.setenv("CUDALAB_PURE_PYTHON", "0")  # (0 or empty: not set)
    assert stacks._load_compiled_stamp() == fake.stamp
    monkeypatch.setenv("CUDALAB_PURE_PYTHON", "1")
    fake.given = None
    assert stacks._load_compiled_stamp() is None and fake.given is None


@needs_compiled
def test_the_compiled_setup_checks_its_arguments():
    from cudalab.memory_tools import _stackstamp

    good = (stacks._cud_mods, stacks._other_mods, stacks._internal, stacks._Mark,
            stacks.capture_stack)
    try:
        for i, bad in [(0, []), (1, frozenset()), (2, set()), (3, dict), (3, int), (4, 5)]:
            args = list(good)
            args[i] = bad
            with pytest.raises(TypeError):
                _stackstamp.setup(*args)
        with pytest.raises(TypeError):
            _stackstamp.setup(*good[:4])
        # the refused setups kept the state: the stamp still gives the real stack
        first = _allocator_method(_stackstamp.stamp)[1]; ln = line()  # noqa: E702
        assert top(stacks.frames_to_dicts(first)) == (
            HERE, ln, "test_the_compiled_setup_checks_its_arguments")
    finally:  # (should a bad one have been taken, the next tests get the real state back)
        _stackstamp.setup(*good)


@needs_compiled
def test_the_compiled_stamp_reads_the_marks_and_calls_capture_only_when_they_miss():
    """Its common case (a loop at one place) needs no call to stacks.capture_stack: only the
    first stamp at each place and the frames without a mark do."""
    from cudalab.memory_tools import _stackstamp

    calls = []

    def counting(d):
        calls.append(d)
        return stacks.capture_stack(d + 1)  # (one more frame: this one)

    shared = (stacks._cud_mods, stacks._other_mods, stacks._internal, stacks._Mark)
    _stackstamp.setup(*shared, counting)
    try:
        got = []
        for _ in range(5):
            got.append(_allocator_method(_stackstamp.stamp)[1]); ln = line()  # noqa: E702
        assert calls == [1]
        assert all(g is got[0] for g in got)
        assert top(stacks.frames_to_dicts(got[0])) == (
            HERE, ln, "test_the_compiled_stamp_reads_the_marks_and_calls_capture_only_when_they_miss")

        def fresh():  # a new frame each call, without a frame object or mark of its own
            a = _allocator_method(_stackstamp.stamp)[1]  # (an allocation, then a free on
            b = _allocator_method(_stackstamp.stamp)[1]  # another line: another stack)
            return a, b

        fs = []
        for _ in range(4):
            fs.append(fresh())
        # only the first call takes the slow path, at each of its lines; the later calls'
        # frames find their stacks through the mark of the loop's frame, their caller
        assert calls == [1, 1, 1]
        assert all(a is fs[0][0] and b is fs[0][1] for a, b in fs)
        assert fs[0][0] != fs[0][1] and fs[0][0][2:] == fs[0][1][2:]
        assert [d["name"] for d in stacks.frames_to_dicts(fs[0][0])[:2]] == [
            "fresh", "test_the_compiled_stamp_reads_the_marks_and_calls_capture_only_when_they_miss"]
    finally:
        _stackstamp.setup(*shared, stacks.capture_stack)


# ------------------------------------------------------------ random call structures
def _kinds():
    """Ways to call the next level: each makes one or more frames of its own kind."""

    def plain(nxt, depth):
        return nxt(depth)

    class Obj:
        def method(self, nxt, depth):
            return nxt(depth)

    def gen(nxt, depth):
        yield nxt(depth)

    def through_gen(nxt, depth):
        return next(gen(nxt, depth))

    ns: dict = {}  # code exec'd without a module name, as a notebook's or a tool's
    exec("def bare(nxt, depth):\n    return nxt(depth)\n", ns)

    def odd(nxt, depth):
        return nxt(depth)

    odd.__module__ = 5  # sys._getframemodulename returns it as is

    def cudalab_named(nxt, depth):  # a frame that says it is cudalab's: skipped by both
        return nxt(depth)

    cudalab_named.__module__ = "cudalab.fake"
    return [plain, Obj().method, through_gen, ns["bare"], odd, cudalab_named,
            lambda nxt, depth: nxt(depth)]


_KINDS = _kinds()


@needs_compiled
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, len(_KINDS) - 1), max_size=12), st.integers(1, 4))
def test_both_stamps_agree_on_random_call_structures(path, repeats):
    """Whatever frames lie between the caller and the allocator (functions, methods,
    generator frames, code without a module or with an odd one, frames that name a cudalab
    module, lambdas), the two stamps give the same stack, stamp after stamp at one place
    (marks hit) and at new places (marks miss), whichever goes first."""
    out: list = []

    def innermost(_depth):
        for i in range(repeats):
            order = (stacks._c_stamp, stacks._py_stamp) if i % 2 else (
                stacks._py_stamp, stacks._c_stamp)
            got = [None, None]
            for j in range(2):  # one call site for both
                got[j ^ (i % 2)] = _allocator_method(order[j])[1]
            out.append(tuple(got))  # (python's, compiled)

    def level(depth):
        if depth == len(path):
            return innermost(depth)
        return _KINDS[path[depth]](level, depth + 1)

    level(0)
    for p, c in out:
        assert stacks.frames_to_dicts(c) == stacks.frames_to_dicts(p)
        assert stacks.frames_to_dicts(c)[0]["name"] == "innermost"
    assert all(c is out[0][0] and p is out[0][0] for p, c in out)  # one place: one stack


@pytest.mark.parametrize("which", ["python", "compiled"])
def test_a_marked_frame_of_a_cudalab_module_not_seen_yet_is_still_skipped(which):
    """A cudalab frame outside a user frame gets a mark when a stack through it is walked
    (as a magic running a cell). When that frame then calls the allocator itself at the
    same instruction, its mark knows a stack starting at it; the stamp must not take it
    before it knows the frame's module, which it learns only then: the stack starts at the
    user frame beyond it."""
    if which == "compiled" and stacks._c_stamp is None:
        pytest.skip("cudalab.memory_tools._stackstamp is not built here")
    stamp = stacks._c_stamp if which == "compiled" else stacks._py_stamp
    got = []

    def user_inner(arg):  # allocates from user code called by the cudalab frame
        got.append(_allocator_method(stamp)[1])

    # cudalab's by module name (3.12+) and by file (3.11), neither seen before
    tag = uuid.uuid4().hex
    ns = {"__name__": f"cudalab.not_seen_{tag}", "user_inner": user_inner,
          "_allocator_method": _allocator_method, "stamp": stamp, "got": got}
    src = ("def cudalab_frame():\n"
           "    for f, arg in ((user_inner, None), (_allocator_method, stamp)):\n"
           "        r = f(arg)  # one instruction: a user function, then the allocator\n"
           "    got.append(r[1])\n")
    filename = os.path.join(os.path.dirname(stacks.__file__), f"not_seen_{tag}.py")
    exec(compile(src, filename, "exec"), ns)
    cudalab_frame = ns["cudalab_frame"]

    def user_outer():
        cudalab_frame(); ln = line()  # noqa: E702
        return ln

    ln = user_outer()
    names = [[d["name"] for d in stacks.frames_to_dicts(s)] for s in got]
    assert names[0][:3] == ["user_inner", "cudalab_frame", "user_outer"]
    assert names[1][0] == "user_outer" and stacks.frames_to_dicts(got[1])[0]["line"] == ln
    if stacks._modname is not None:
        assert ns["__name__"] in stacks._cud_mods
    else:
        assert stacks._internal[filename] is True


# ---------------------------------------------------------------- the memo's stamp log
def _logs(maxlen):
    """The two kinds of stamp log the history hands the allocator: the compiled HitLog
    (where it is built) and the deque it replaces."""
    from collections import deque

    out = [deque(maxlen=maxlen)]
    if stacks._c_stamp is not None:
        from cudalab.memory_tools import _stackstamp

        out.append(_stackstamp.HitLog(maxlen, time.time_ns, stacks._HIT_CLOCK))
    return out


@pytest.mark.parametrize("maxlen", [2, 6, 1000])
def test_the_stamp_logs_keep_the_newest_stamps_oldest_first_like_a_deque(maxlen):
    """HitLog is a drop-in for the bounded deque: the same contents after any run of
    appends (in pairs), through several rounds of dropping the oldest, and after clear."""
    logs = _logs(maxlen)
    for n in range(0, 3 * maxlen + 7):
        for log in logs:
            log.append(2 * n)
            log.append(2 * n + 1)
        seen = [list(log) for log in logs]
        assert all(s == seen[0] for s in seen), seen
        assert all(len(log) == len(seen[0]) <= maxlen for log in logs)
        assert all(bool(log) for log in logs)
    assert seen[0][-1] == 2 * n + 1 and len(seen[0]) == maxlen
    for log in logs:
        log.clear()
        assert len(log) == 0 and not log and list(log) == []


@needs_compiled
def test_a_hit_logs_the_free_stamp_then_a_fresh_stamp_of_each_kind():
    from cudalab.memory_tools import _stackstamp

    t0 = time.time_ns()
    log = _stackstamp.HitLog(8, time.time_ns, stacks._HIT_CLOCK)
    log.hit(0)
    log.hit(123)
    free0, now0, free1, now1 = list(log)
    assert (free0, free1) == (0, 123) and t0 <= now0 <= now1 <= time.time_ns()
    calls = []
    log = _stackstamp.HitLog(4, lambda: calls.append(1) or ("t", "stack"), stacks._HIT_CALL)
    for i in range(5):
        log.hit(i)
    assert list(log) == [3, ("t", "stack"), 4, ("t", "stack")] and len(calls) == 5
    # the compiled stack stamp, called directly: what the stamp gives from the same frame
    log = _stackstamp.HitLog(4, stacks._c_stamp, stacks._HIT_STAMP)
    for _ in range(2):  # (the second time from the mark the first left)
        log.clear()
        _, expected, here = _allocator_method(log.hit, 7), _allocator_method(stacks._c_stamp), line()
        free, (t, stack) = list(log)
        assert free == 7 and t0 <= t <= expected[0]
        assert stacks.frames_to_dicts(stack) == stacks.frames_to_dicts(expected[1])
        assert top(stacks.frames_to_dicts(stack)) == (HERE, here, _name())


@needs_compiled
def test_the_stamp_log_checks_its_arguments_and_passes_errors_on():
    from cudalab.memory_tools import _stackstamp

    for bad in [0, 1, 3, -2, 1 << 62]:
        with pytest.raises(ValueError, match="maxlen must be even"):
            _stackstamp.HitLog(bad, time.time_ns, stacks._HIT_CLOCK)
    with pytest.raises(ValueError, match="unknown kind"):
        _stackstamp.HitLog(2, time.time_ns, 7)
    with pytest.raises(TypeError, match="callable"):
        _stackstamp.HitLog(2, 5, stacks._HIT_CALL)

    def boom():
        raise KeyError("stamp failed")

    log = _stackstamp.HitLog(2, boom, stacks._HIT_CALL)
    with pytest.raises(KeyError, match="stamp failed"):
        log.hit(1)
    assert list(log) == []  # nothing half logged


def test_the_history_hands_the_allocator_the_log_of_its_stamp(monkeypatch):
    """hit_log picks the compiled log only with the compiled stamp in use, of the kind that
    matches the hit stamp; the pure-Python stamp gets the deque (nothing compiled)."""
    from collections import deque

    if stacks._c_stamp is None:
        assert type(stacks.hit_log(4, time.time_ns)) is deque
        return
    from cudalab.memory_tools import _stackstamp

    assert type(stacks.hit_log(4, time.time_ns)) is _stackstamp.HitLog
    assert type(stacks.hit_log(None, stacks._c_stamp)) is _stackstamp.HitLog
    assert len(stacks.hit_log(None, time.time_ns)) == 0
    monkeypatch.setattr(stacks, "_stamp", stacks._py_stamp)
    assert type(stacks.hit_log(4, time.time_ns)) is deque
