"""The torch-style pair's C twins (cudalab/allocator/_pair.c, issue 37 section 3) and the
Python pair they fall back to: the same pointers, counters and errors, every case that is
not a pure hit handed to Python, and a pure hit made without a Python frame.

Both implementations run: in this process whichever is bound (the twins where built), and
in child processes each one explicitly (``CUDALAB_FASTPAIR=0`` keeps the Python pair).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cudalab
import cudalab.memory as cm
from cudalab import _observe, devices, streams
from cudalab.allocator.caching import PAIR_FIELDS, compiled_pair

try:
    from cudalab.allocator import _pair  # type: ignore[attr-defined]
except ImportError:  # not built (CUDALAB_PURE_PYTHON, no compiler, another Python)
    _pair = None

needs_c = pytest.mark.skipif(_pair is None or os.environ.get("CUDALAB_FASTPAIR") == "0",
                             reason="cudalab.allocator._pair is not built or is turned off")


def _frames_of(call):
    """The Python functions entered while ``call()`` runs."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not call.__code__:
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def _warm_pair(size=4096):
    """Two pairs of ``size``: the second sets up the pair memo's pure hit."""
    cudalab.synchronize()
    for _ in range(3):
        cm.caching_allocator_delete(cm.caching_allocator_alloc(size))


@needs_c
def test_the_twins_are_bound_named_and_documented_as_the_python_pair():
    for twin, python in ((cm.caching_allocator_alloc, cm.python_caching_allocator_alloc),
                         (cm.caching_allocator_delete, cm.python_caching_allocator_delete)):
        assert inspect.isbuiltin(twin), twin
        assert twin.__name__ == python.__name__
        assert twin.__module__ == "cudalab.memory"
        assert twin.__doc__ == python.__doc__
        assert ([(x.name, x.default) for x in inspect.signature(twin).parameters.values()]
                == [(x.name, x.default) for x in inspect.signature(python).parameters.values()])
    assert cudalab.caching_allocator_alloc is cm.caching_allocator_alloc


@needs_c
def test_a_pure_hit_runs_no_python_frame_and_a_miss_runs_the_python_pair():
    _warm_pair()
    assert _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(4096))) == []
    # another size: no pure hit, the allocator's own methods run (not the Python wrappers)
    entered = _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(8192)))
    assert "malloc" in entered and "free" in entered
    assert "caching_allocator_alloc" not in entered and "caching_allocator_delete" not in entered
    # arguments the fast case does not take: Python, whatever the memo holds
    _warm_pair()
    for call in (lambda: cm.caching_allocator_alloc(4096, 0),
                 lambda: cm.caching_allocator_alloc(4096, stream=cudalab.current_stream()),
                 lambda: cm.caching_allocator_alloc(size=4096)):
        entered = _frames_of(lambda call=call: cm.caching_allocator_delete(call()))
        assert "caching_allocator_alloc" in entered, entered


@needs_c
def test_a_hit_counts_as_the_python_hit_does():
    _warm_pair()
    a = cm.get_allocator(0)
    hits = a._memo_hits
    p = cm.caching_allocator_alloc(4096)
    assert a._memo_hits == hits + 1 and p in a.live and not a._ready
    cm.caching_allocator_delete(p)
    assert p not in a.live and a._ready == [a.memo_block]
    a.check_invariants()


@needs_c
def test_bad_arguments_raise_as_the_python_pair():
    for bad in (True, 1.5, "4096", -1):
        with pytest.raises((TypeError, ValueError)) as twin:
            cm.caching_allocator_alloc(bad)
        with pytest.raises(type(twin.value)) as python:
            cm.python_caching_allocator_alloc(bad)
        assert str(twin.value) == str(python.value)
    assert cm.caching_allocator_alloc(0) == 0
    assert cm.caching_allocator_delete(0) is None
    for bad in (0xBAD0, "p", 1.0):
        with pytest.raises((TypeError, ValueError)) as twin:
            cm.caching_allocator_delete(bad)
        with pytest.raises(type(twin.value)) as python:
            cm.python_caching_allocator_delete(bad)
        assert str(twin.value) == str(python.value)
    _warm_pair()
    p = cm.caching_allocator_alloc(4096)
    cm.caching_allocator_delete(p)
    with pytest.raises(ValueError, match=hex(p)):  # a double free of the memo's block
        cm.caching_allocator_delete(p)
    with pytest.raises(TypeError):
        cm.caching_allocator_alloc()
    with pytest.raises(TypeError):
        cm.caching_allocator_alloc(1, 2, 3, 4)


@needs_c
def test_a_held_lock_is_waited_for():
    """The twin never makes a hit while another thread holds the allocator's lock: it hands
    the call to Python, which waits for the lock."""
    _warm_pair()
    a = cm.get_allocator(0)
    got = []
    a._lock.acquire()
    try:
        t = threading.Thread(target=lambda: got.append(cm.caching_allocator_alloc(4096)))
        t.start()
        time.sleep(0.05)
        assert got == [] and t.is_alive()
    finally:
        a._lock.release()
    t.join(5)
    assert len(got) == 1 and got[0] in a.live
    cm.caching_allocator_delete(got[0])
    a.check_invariants()


@needs_c
def test_a_history_hook_or_the_sanitizer_takes_the_python_pair(monkeypatch):
    _warm_pair()
    a = cm.get_allocator(0)
    seen = []
    monkeypatch.setattr(a, "_trace", lambda *entry: seen.append(entry[0]))
    entered = _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(4096)))
    assert "malloc" in entered and "free" in entered
    monkeypatch.setattr(a, "_trace", None)
    _warm_pair()
    monkeypatch.setattr(_observe, "access_on", True)
    monkeypatch.setattr(_observe, "access_tracker", _NullTracker())
    entered = _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(4096)))
    assert "caching_allocator_alloc" in entered and "caching_allocator_delete" in entered


class _NullTracker:
    def allocated(self, *args):
        pass

    def freed(self, *args):
        pass


@needs_c
def test_a_custom_current_stream_hits_on_this_threads_stream():
    """stream=None means this thread's current stream: with a side stream current, the hit
    is made when that Stream object is the memo's (as Python's third pure-hit case), and
    the memo of the default stream is not handed out on it."""
    _warm_pair()
    s = cudalab.Stream()
    with cudalab.stream(s):
        assert streams.custom_stream_tokens
        p = cm.caching_allocator_alloc(4096)
        assert cm.get_allocator(0).live[p].fl.stream == s.cuda_stream
        cm.caching_allocator_delete(p)
        _warm_pair()
        assert _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(4096))) == []
        p = cm.caching_allocator_alloc(4096)
        assert cm.get_allocator(0).live[p].fl.stream == s.cuda_stream
        cm.caching_allocator_delete(p)
    p = cm.caching_allocator_alloc(4096)  # the default stream again: not s's block
    assert cm.get_allocator(0).live[p].fl.stream == cudalab.current_stream().cuda_stream
    cm.caching_allocator_delete(p)


def test_binding_again_gives_working_twins():
    twins = compiled_pair(cm.python_caching_allocator_alloc, cm.python_caching_allocator_delete,
                          cm._allocators, cm._active, vars(devices), vars(_observe),
                          streams.custom_stream_tokens, "cudalab.memory")
    if _pair is None or os.environ.get("CUDALAB_FASTPAIR") == "0":
        assert twins is None
        return
    alloc, delete = twins
    _warm_pair()
    for _ in range(3):
        p = alloc(4096)
        assert p in cm.get_allocator(0).live
        delete(p)
    with pytest.raises(TypeError, match="slots"):
        _pair.bind(cm.python_caching_allocator_alloc, cm.python_caching_allocator_delete,
                   type(cm.get_allocator(0)), ("malloc",) * len(PAIR_FIELDS), *_binding_rest())
    with pytest.raises(TypeError, match="12 arguments"):
        _pair.bind()


def _binding_rest():
    from cudalab.allocator.blocks import Block
    from cudalab.allocator.token_lock import TokenLock

    return (Block, TokenLock, cm._allocators, cm._active, vars(devices), vars(_observe),
            streams.custom_stream_tokens, "cudalab.memory")


_SEQUENCE = """
    import json, cudalab, cudalab.memory as cm
    cudalab.init()
    out = {"builtin": type(cm.caching_allocator_alloc).__name__, "steps": []}
    live = []
    # pure hits, another size between, a split remainder, a large block, frees out of order
    for size in [4096] * 6 + [8192, 4096, 4096, 700, 700, 3 << 20, 4096, 4096]:
        live.append(cm.caching_allocator_alloc(size))
        if size != 3 << 20:
            cm.caching_allocator_delete(live.pop())
        out["steps"].append([live[:], cm.memory_allocated(), cm.memory_reserved()])
    for p in live:
        cm.caching_allocator_delete(p)
    out["stats"] = cm.memory_stats()
    cm.get_allocator(0).check_invariants()
    print(json.dumps(out))
"""


_HISTORY = """
    import json, cudalab, cudalab.memory as cm
    cudalab.init()
    cm._record_memory_history("all", stacks="python")

    def work(size):
        p = cm.caching_allocator_alloc(size)
        return p

    def drop(p):
        cm.caching_allocator_delete(p)

    for size in [4096] * 5 + [8192, 4096, 4096, 700, 4096]:
        drop(work(size))
    snap = cm._snapshot()
    entries = [[e["action"], e["addr"], e["size"], e["stream"],
                [[f["name"], f["filename"].rsplit("/", 1)[-1], f["line"]] for f in e["frames"]]]
               for e in snap["device_traces"][0]]
    print(json.dumps({"entries": entries, "stats": cm.memory_stats()}))
"""


def test_the_twins_record_the_same_history_as_the_python_pair():
    """History with stacks: the pairs made through the twins give the entries, stacks (a
    free's with the API frame, as torch's) and counters the Python pair gives."""
    results = {}
    for fast in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
        env.update(CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES="1", CUDALAB_FASTPAIR=fast)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_HISTORY)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        results[fast] = json.loads(r.stdout)
    entries = results["0"]["entries"]
    assert len(entries) >= 20 and {e[0] for e in entries} >= {"alloc", "free_requested",
                                                             "free_completed"}
    assert any(f[0] == "work" for f in entries[0][4])  # the stacks are the user's
    assert results["1"] == results["0"]


@needs_c
def test_a_traced_pair_keeps_the_frames_the_history_shows():
    """With history on, the allocation is the allocator's malloc called by the twin (its
    frame is what the stack stamps skip), the free the Python function (its frame is on a
    free's stack, as torch's caching_allocator_delete is on torch's)."""
    cm._record_memory_history("all", stacks="python")
    try:
        _warm_pair()
        entered = _frames_of(lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(4096)))
        assert "malloc" in entered and "free" in entered
        assert "caching_allocator_alloc" not in entered and "caching_allocator_delete" in entered
    finally:
        cm._record_memory_history(None)


@pytest.mark.parametrize("devices_count", ["1", "2"])
def test_the_twins_and_the_python_pair_leave_the_same_state(devices_count):
    """One sequence in two fresh processes (one device, and two: the per-thread device read),
    each pair: the same pointers, counters and statistics (after the memo's flush)."""
    results = {}
    for fast in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
        env.update(CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES=devices_count,
                   CUDALAB_FASTPAIR=fast)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SEQUENCE)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        results[fast] = json.loads(r.stdout)
    assert results["0"]["builtin"] == "function"
    if _pair is not None:
        assert results["1"]["builtin"] == "builtin_function_or_method"
    assert results["0"]["steps"] == results["1"]["steps"]
    assert results["0"]["stats"] == results["1"]["stats"]
