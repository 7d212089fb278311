"""Allocation history (``cudalab.memory._record_memory_history`` / ``record_history``):
torch's enabled/context/stacks/max_entries semantics, the ring buffer, the trace points of
every allocator flavour, stacks, NVTX ranges and notebook cells, and zero cost when off.

Most tests record a private allocator (attached with ``history.attach_allocator``) so the
process allocator's cache cannot change what is seen; its entries land in device 0's ring.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
import weakref

import pytest

import cudalab
from cudalab.allocator import registry as A
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.registry import native_allocator
from cudalab.allocator.uncached import UncachedAllocator
from cudalab.errors import OutOfMemoryError
from cudalab.memory_tools import history, stacks

KiB = 1024
MiB = 1024 * 1024
HERE = os.path.abspath(__file__)
PKG = os.path.dirname(os.path.abspath(cudalab.__file__)) + os.sep


def line() -> int:
    """The caller's current line."""
    return sys._getframe(1).f_lineno


def make(backend, conf: str | None = None) -> DeviceCachingAllocator:
    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    return native_allocator(backend, 0, cfg, stream_resolver=lambda: 0)


# Every test here runs with each stamp this Python has: the pure-Python one and, where it
# was built (CPython 3.11-3.13), its C twin cudalab.memory_tools._stackstamp.
STAMPS = ["python"] + (["compiled"] if stacks._c_stamp is not None else [])


@pytest.fixture(autouse=True, params=STAMPS)
def stamp(request):
    before = stacks.stamp_implementation()
    stacks._use_stamp(request.param)
    yield request.param
    stacks._use_stamp(before)


@pytest.fixture(autouse=True)
def _history_off():
    """Every test starts and ends with recording off and no cell id."""
    gc.collect()
    cudalab.memory._record_memory_history(None)
    history.set_current_cell(None)
    yield
    cudalab.memory._record_memory_history(None)
    history.set_current_cell(None)
    for a in list(history._extra):
        history.detach_allocator(a)


@pytest.fixture
def priv(backend):
    """Factory of private native allocators that are recorded; emptied after the test."""
    made = []

    def factory(conf: str | None = None, kind=None):
        a = kind(backend, 0, AllocatorConfig()) if kind else make(backend, conf)
        history.attach_allocator(a)
        made.append(a)
        return a

    yield factory
    for a in made:
        history.detach_allocator(a)
        for p in list(a.live):
            a.free(p)
        a.empty_cache()


def trace(addrs=None, device: int = 0) -> list[dict]:
    """Device ``device``'s trace entries (optionally only those at the given addresses)."""
    out = history.trace_entries(device)
    if addrs is not None:
        out = [e for e in out if e.get("addr") in addrs]
    return out


def acts(entries) -> list[tuple]:
    return [(e["action"], e["size"]) for e in entries]


def top(frames) -> tuple:
    f = frames[0]
    return (f["filename"], f["line"], f["name"])


# Stack caches are not set while a trace function runs (coverage, a debugger): the tests
# that look at them need none.
needs_no_tracer = pytest.mark.skipif(sys.gettrace() is not None,
                                     reason="a trace function is set (coverage or a debugger)")


# --------------------------------------------------------------------------- entries
def test_entries_for_alloc_free_and_segments(priv):
    a = priv()
    cudalab.memory._record_memory_history()
    t0 = time.time_ns() // 1000
    p, ln = a.malloc(1000, 0), line()
    a.free(p)
    a.empty_cache()
    t1 = time.time_ns() // 1000
    es = trace({p})
    assert acts(es) == [("segment_alloc", 2 * MiB), ("alloc", 1000), ("free_requested", 1000),
                        ("free_completed", 1000), ("segment_free", 2 * MiB)]
    for e in es:
        assert e["addr"] == p and e["stream"] == 0 and e["device"] == 0
        assert t0 <= e["time_us"] <= t1
        assert e["compile_context"] == "" and e["user_metadata"] == ""
        assert e["nvtx_range"] is None and e["cell"] is None
    assert [e["time_us"] for e in es] == sorted(e["time_us"] for e in es)
    # context="all": allocation and segment entries carry the allocating line, free and
    # segment_free entries the freeing lines
    assert top(es[0]["frames"]) == (HERE, ln, "test_entries_for_alloc_free_and_segments")
    assert top(es[1]["frames"]) == (HERE, ln, "test_entries_for_alloc_free_and_segments")
    assert top(es[2]["frames"])[1] == ln + 1 and top(es[3]["frames"])[1] == ln + 1
    assert top(es[4]["frames"])[1] == ln + 2


def test_frames_are_the_python_stack_without_cudalab(priv):
    a = priv()
    cudalab.memory._record_memory_history()
    p, expected = a.malloc(4096, 0), traceback.extract_stack()
    (alloc,) = [e for e in trace({p}) if e["action"] == "alloc"]
    got = [(f["filename"], f["line"], f["name"]) for f in alloc["frames"]]
    want = [(f.filename, f.lineno, f.name) for f in reversed(expected)]
    assert got == want
    assert not any(f["filename"].startswith(PKG) for f in alloc["frames"])


def test_frames_of_notebook_like_cells_reuse_the_outer_stack_correctly(priv):
    """A cell runs as a "<module>" frame deep inside the kernel; the frames beyond it are
    walked once per cell and reused: every stack must still equal the real one."""
    a = priv()
    cudalab.memory._record_memory_history()
    src = ("p1, s1 = a.malloc(1000, 0), traceback.extract_stack()\n"
           "def f():\n"
           "    return a.malloc(2000, 0), traceback.extract_stack()\n"
           "p2, s2 = f()\n")

    def kernel(depth, name):
        if depth:
            return kernel(depth - 1, name)
        ns = {"a": a, "traceback": traceback}
        exec(compile(src, name, "exec"), ns)
        return ns

    cells = [kernel(5, "<cell-1>"), kernel(5, "<cell-1>"), kernel(8, "<cell-2>")]
    allocs = {e["addr"]: e for e in trace() if e["action"] == "alloc"}
    for ns in cells:
        for p, s in ((ns["p1"], ns["s1"]), (ns["p2"], ns["s2"])):
            got = [(f["filename"], f["line"], f["name"]) for f in allocs[p]["frames"]]
            assert got == [(f.filename, f.lineno, f.name) for f in reversed(s)]
        a.free(ns["p1"])
        a.free(ns["p2"])


def _allocs_with_real_stacks(entries, got, action="alloc"):
    """Check that each allocation in ``got`` (pointer, extract_stack() taken on the same
    line) has exactly that stack in its ``action`` entry of ``entries`` (the last entries
    of each address: earlier allocations there may be in ``entries`` too)."""
    by_addr: dict = {}
    for e in entries:
        if e["action"] == action:
            by_addr.setdefault(e["addr"], []).append(e)
    seen: dict = {}
    for p, _ in got:
        seen[p] = seen.get(p, 0) - 1
    for p, s in got:
        k = seen[p]
        seen[p] = k + 1
        e = by_addr[p][k]
        frames = [(f["filename"], f["line"], f["name"]) for f in e["frames"]]
        assert frames == [(f.filename, f.lineno, f.name) for f in reversed(s)]


def test_cached_stacks_are_the_real_stacks(priv):
    """Frames cache their stacks (see stacks.capture_stack): callers that come and go at reused
    addresses, recursion, generators resumed from different places, two lines of one frame
    and another thread must all still get their real stack."""
    a = priv()
    cudalab.memory._record_memory_history()
    got: list = []
    freed: list = []

    def here():
        p, s = a.malloc(1000, 0), traceback.extract_stack()
        got.append((p, s))
        _, s = a.free(p), traceback.extract_stack()
        freed.append((p, s))

    def caller1():
        here()

    def caller2():
        here()
        here()

    def recurse(n):
        return here() if n == 0 else recurse(n - 1)

    def gen():
        for _ in range(6):
            here()
            yield

    def two_lines():
        here()
        here()

    g = gen()

    def resume():
        next(g)

    def fresh(i):  # a new code object each time (the old one freed: its id may come again)
        ns = {"here": here}
        exec(compile(f"def f{i}():\n    here()\n", f"<fresh {i}>", "exec"), ns)
        return ns[f"f{i}"]

    for i in range(6):
        caller1()
        caller2()
        recurse(i % 3)
        two_lines()
        here()
        (resume if i % 2 else lambda: next(g, None))()
        for fn in (caller1, two_lines, caller1, fresh(i)):  # one call site, other functions
            fn()
    t = threading.Thread(target=caller2)
    t.start()
    t.join()
    es = trace()
    _allocs_with_real_stacks(es, got)
    _allocs_with_real_stacks(es, freed, "free_requested")
    assert len(got) == len(freed) == 6 * 13 + 2


@pytest.mark.parametrize("context", ["state", "alloc", "all"])
def test_memo_pairs_of_a_loop_carry_their_stacks(priv, context, monkeypatch):
    """A loop's alloc+free pairs are logged compactly (stamps of time and stack) and
    written out with the stacks each entry would have had."""
    monkeypatch.setattr(cudalab.nvtx, "ranges_used", False)  # as if no test had pushed a range
    a = priv()
    cudalab.memory._record_memory_history(context=context)
    got, frees = [], []
    compact = False
    for _ in range(6):
        p, s = a.malloc(4096, 0), traceback.extract_stack()
        got.append((p, s))
        a.free(p)
        frees.append(line() - 1)
        compact = compact or a._hit_log is not None
    assert compact
    es = trace({got[0][0]})
    if context == "state":
        assert all(e["frames"] == [] for e in es)
        return
    _allocs_with_real_stacks(es, got)
    freed = [e for e in es if e["action"].startswith("free_")]
    assert len(freed) == 12
    for k, e in enumerate(freed):
        want = got[k // 2][1][-1].lineno if context == "alloc" else frees[k // 2]
        assert top(e["frames"]) == (HERE, want, "test_memo_pairs_of_a_loop_carry_their_stacks")


@needs_no_tracer
def test_cached_stacks_keep_no_frame_alive(priv):
    """A frame's stack cache lives on the frame: once the function returns, its locals
    are freed as without recording."""
    a = priv()
    cudalab.memory._record_memory_history()

    class Local:
        pass

    def work():
        o = Local()
        p = a.malloc(1000, 0)
        a.free(p)
        assert isinstance(sys._getframe().f_trace, stacks._Mark)  # the cache is here
        return weakref.ref(o)

    r = work()
    assert r() is None


def test_stacks_of_new_frames_at_one_site_are_one_tuple(priv):
    """Each call of a function makes a new frame; the entries of the same site still share
    one stack tuple (memory in the ring, one conversion in a snapshot)."""
    a = priv()
    cudalab.memory._record_memory_history()

    def step(n):
        a.free(a.malloc(1000 + 512 * (n % 2), 0))  # two sizes: no memo, plain entries

    def layer(n):
        step(n)

    for n in range(6):
        layer(n)
    frames = [e[5] for e in history.raw_entries(0) if e[0] == "alloc"][-6:]
    assert len(frames) == 6 and frames[0] and all(f is frames[0] for f in frames)


@needs_no_tracer
def test_a_frame_keeps_a_bounded_number_of_stacks(priv):
    """A long-running frame that calls ever new code objects (generated functions) does
    not keep a stack for each of them."""
    a = priv()
    cudalab.memory._record_memory_history()
    for i in range(stacks._MARK_MAX + 50):
        ns = {"a": a}
        exec(compile(f"def f{i}():\n    a.free(a.malloc(1000, 0))\n", "<gen>", "exec"), ns)
        ns[f"f{i}"]()
    mark = sys._getframe().f_trace
    assert isinstance(mark, stacks._Mark) and 0 < len(mark) <= stacks._MARK_MAX


@needs_no_tracer
def test_no_cache_under_a_trace_function_or_in_generators(priv):
    """Debuggers and coverage keep their f_trace, and frames are not marked while a trace
    function is set; a frame marked before one is set runs on as without a local one;
    generator frames are never marked."""
    a = priv()
    cudalab.memory._record_memory_history()
    events: list = []

    def local(frame, event, arg):
        events.append(event)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is work.__code__ else None

    def work():
        p = a.malloc(1000, 0)
        a.free(p)
        return sys._getframe().f_trace

    def untraced():  # the tracer gives it no local trace function
        a.free(a.malloc(1000, 0))
        return sys._getframe().f_trace

    def own():  # a frame with its own f_trace while no trace function is set
        sys._getframe().f_trace = local
        a.free(a.malloc(1000, 0))
        return sys._getframe().f_trace

    def gen():
        a.free(a.malloc(1000, 0))
        yield sys._getframe().f_trace

    a.free(a.malloc(1000, 0))
    mine = sys._getframe().f_trace
    assert isinstance(mine, stacks._Mark)
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        ft = work()
        assert untraced() is None
        x = 1  # a line of this (marked) frame while tracing: no local trace, no error
        p, s = a.malloc(2000, 0), traceback.extract_stack()
    finally:
        sys.settrace(old)
    assert ft is local and "line" in events and x == 1
    assert sys._getframe().f_trace is mine
    a.free(p)
    _allocs_with_real_stacks(trace({p}), [(p, s)])
    assert isinstance(untraced(), stacks._Mark) and next(gen()) is None
    assert own() is local


def test_frames_through_the_public_api_start_at_the_caller():
    cudalab.init()
    cudalab.memory._record_memory_history()
    p, ln = cudalab.memory.caching_allocator_alloc(3000), line()
    cudalab.memory.caching_allocator_delete(p)
    es = [e for e in trace({p}) if e["action"] in ("alloc", "free_requested")]
    assert top(es[0]["frames"]) == (HERE, ln, "test_frames_through_the_public_api_start_at_the_caller")
    # a free's stack keeps the frame of the torch.cuda.memory function called, as torch's
    # (torch writes that API in Python), and drops only the frames inside it
    api, caller = es[1]["frames"][:2]
    assert api["name"] == "caching_allocator_delete"
    assert os.path.abspath(api["filename"]) == os.path.abspath(cudalab.memory.__file__)
    assert (caller["filename"], caller["line"]) == (HERE, ln + 1)


@pytest.mark.parametrize("module", ["user_module", None])
def test_memo_stamps_through_the_public_api_start_at_the_caller(module):
    """The memo's stamps (stacks._stamp) skip cudalab's frames (here the array's and the
    allocator's) by module name, learning the names while recording, for code of a named
    module and for code run without one (exec'd in bare globals): the allocation and free
    stacks of a loop over ``cudalab.empty`` are the real ones."""
    cudalab.init()
    # emptied in place (the compiled stamp holds these very sets), refilled after
    saved = set(stacks._cud_mods), set(stacks._other_mods)
    stacks._cud_mods.clear()
    stacks._other_mods.clear()
    try:
        _memo_stamps_start_at_the_caller(module)
    finally:
        stacks._cud_mods.update(saved[0])
        stacks._other_mods.update(saved[1])


def _memo_stamps_start_at_the_caller(module) -> None:
    alloc = cudalab.memory.get_allocator(0)
    src = ("def run(n):\n"
           "    got, freed, compact = [], [], []\n"
           "    for _ in range(n):\n"
           "        x, s = empty(256), extract_stack()\n"
           "        p = x.data_ptr()\n"
           "        got.append((p, s))\n"
           "        compact.append(logged())\n"
           "        del x; freed.append((p, extract_stack()))\n"
           "    return got, freed, compact\n")
    ns = {"empty": cudalab.empty, "extract_stack": traceback.extract_stack,
          "logged": lambda: alloc._hit_log is not None}
    if module is not None:
        ns["__name__"] = module
    exec(compile(src, "<user code>", "exec"), ns)
    cudalab.memory._record_memory_history()
    got, freed, compact = ns["run"](8)
    assert any(compact)
    es = trace({p for p, _ in got})
    _allocs_with_real_stacks(es, got)
    _allocs_with_real_stacks(es, freed, "free_requested")
    if stacks._modname is not None:  # Python 3.12+ (3.11 tells cudalab's frames by file)
        assert "cudalab.array" in stacks._cud_mods
        assert (module in stacks._other_mods) == (module is not None)


@pytest.mark.parametrize("module", [5, ["not", "hashable"]])
def test_functions_with_odd_module_names_allocate_and_get_their_stacks(module):
    """A function's ``__module__`` can be anything (sys._getframemodulename returns it as
    is): allocating from it while recording must work, plain and memo paths alike, with
    the function as the innermost frame."""
    cudalab.init()
    cudalab.memory._record_memory_history()

    def loop(n):
        for _ in range(n):
            x, s = cudalab.empty(256), traceback.extract_stack()
            got.append((x.data_ptr(), s))
            del x

    got: list = []
    loop.__module__ = module
    loop(6)
    es = trace({p for p, _ in got})
    _allocs_with_real_stacks(es, got)


def test_oom_entry_on_a_tiny_simulated_device(monkeypatch):
    from cudalab._driver.sim import SimulatorBackend

    monkeypatch.setenv("CUDALAB_SIMULATOR_MEMORY", "64MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sim = SimulatorBackend()
    sim.init()
    a = make(sim)
    history.attach_allocator(a)
    cudalab.memory._record_memory_history()
    p = a.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(30 * MiB)
    ln = line() - 1
    es = history.trace_entries(0)
    oom = [e for e in es if e["action"] == "oom"]
    assert len(oom) == 1
    (e,) = oom
    assert "addr" not in e and e["device_free"] == 24 * MiB  # 64 - 40 MiB in use
    assert e["size"] == 30 * MiB and e["stream"] == 0
    assert top(e["frames"])[1] == ln
    snap = cudalab.memory._snapshot(allocators=[a])
    (soom,) = [x for x in snap["device_traces"][0] if x["action"] == "oom"]
    assert soom["device_free"] == 24 * MiB
    history.detach_allocator(a)
    a.free(p)
    a.empty_cache()


def test_record_stream_free_requested_then_completed_later(backend, priv):
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    a = priv()
    cudalab.memory._record_memory_history()
    p, ln = a.malloc(4096, s1), line()
    a.record_stream(p, s2)
    if hasattr(backend, "pause_stream"):
        backend.pause_stream(s2.handle)
    else:  # a real GPU: keep s2 busy for a while
        from cudalab._kernels.spin import gpu_sleep

        gpu_sleep(500_000_000, stream=s2)
    a.free(p)
    assert [e["action"] for e in trace({p})][-1] == "free_requested"
    snap = cudalab.memory._snapshot(allocators=[a])
    (blk,) = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == p]
    assert blk["state"] == "active_pending_free"
    assert top(blk["frames"])[1] == ln  # still the allocation's stack
    if hasattr(backend, "resume_stream"):
        backend.resume_stream(s2.handle)
    s2.synchronize()
    q = a.malloc(4096, s1)  # processes the completed event
    acts_p = [e["action"] for e in trace({p, q})]
    i = acts_p.index("free_requested")
    assert "free_completed" in acts_p[i + 1:]
    (done,) = [e for e in trace({p}) if e["action"] == "free_completed"]
    assert top(done["frames"])[1] == ln  # completed outside the free: the allocation's stack
    a.free(q)


def test_uncached_allocator_entries(backend, priv):
    a = priv(kind=UncachedAllocator)
    cudalab.memory._record_memory_history()
    p = a.malloc(5000)
    a.free(p)
    assert acts(trace({p})) == [("segment_alloc", 5000), ("alloc", 5000),
                                ("free_requested", 5000), ("free_completed", 5000),
                                ("segment_free", 5000)]
    assert all(top(e["frames"])[0] == HERE for e in trace({p}))


def test_pluggable_allocator_entries(backend):
    from cudalab.allocator.pluggable import PluggableAllocator, PluggableDeviceAllocator

    spec = PluggableAllocator(lambda size, dev, s: backend.mem_alloc(dev, size),
                              lambda ptr, size, dev, s: backend.mem_free(dev, ptr))
    a = PluggableDeviceAllocator(spec, backend, 0, stream_resolver=lambda: 0)
    history.attach_allocator(a)
    cudalab.memory._record_memory_history()
    p, ln = a.malloc(640), line()
    a.free(p)
    es = trace({p})
    assert acts(es) == [("segment_alloc", 640), ("alloc", 640), ("free_requested", 640),
                        ("free_completed", 640), ("segment_free", 640)]
    assert [top(e["frames"])[1] for e in es] == [ln, ln, ln + 1, ln + 1, ln + 1]


def test_expandable_segments_map_and_unmap_entries(priv):
    a = priv("expandable_segments:True")
    cudalab.memory._record_memory_history()
    p, ln = a.malloc(1 * MiB), line()
    a.free(p)
    a.empty_cache()
    es = [e for e in trace() if e["action"] in ("segment_map", "segment_unmap", "alloc",
                                                 "free_requested", "free_completed")]
    assert [e["action"] for e in es] == ["segment_map", "alloc", "free_requested",
                                        "free_completed", "segment_unmap"]
    assert es[0]["addr"] == p and es[0]["size"] == 2 * MiB
    assert es[-1]["addr"] == p and es[-1]["size"] == 2 * MiB
    assert top(es[0]["frames"])[1] == ln and top(es[1]["frames"])[1] == ln


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("context", [None, "state", "alloc", "all"])
def test_context_decides_where_stacks_go(priv, context):
    a = priv()
    cudalab.memory._record_memory_history(context=context)
    keep, ln = a.malloc(2048, 0), line()
    p = a.malloc(1000, 0)
    a.free(p)
    ln_free = line() - 1
    es = {e["action"]: e for e in trace({p})}
    blocks = {b["address"]: b for s in cudalab.memory._snapshot(allocators=[a])["segments"]
              for b in s["blocks"]}
    alloc_fr, freq_fr, fdone_fr = (es[k]["frames"] for k in
                                   ("alloc", "free_requested", "free_completed"))
    if context is None:
        assert alloc_fr == freq_fr == fdone_fr == [] and blocks[keep]["frames"] == []
    else:  # every context keeps the stack of live blocks
        assert top(blocks[keep]["frames"])[1] == ln
    if context == "state":
        assert alloc_fr == freq_fr == fdone_fr == []
    if context == "alloc":  # free entries show the allocation's stack (torch)
        assert top(alloc_fr)[1] == ln + 1
        assert top(freq_fr)[1] == ln + 1 and top(fdone_fr)[1] == ln + 1
    if context == "all":
        assert top(alloc_fr)[1] == ln + 1
        assert top(freq_fr)[1] == ln_free and top(fdone_fr)[1] == ln_free
    assert blocks[p]["frames"] == []  # freed: no stack


def test_stacks_none_captures_nothing(priv):
    a = priv()
    cudalab.memory._record_memory_history(stacks=None)
    assert history.history_settings()["stacks"] is None
    keep = a.malloc(2048, 0)
    assert all(e["frames"] == [] for e in trace({keep}))
    blocks = [b for s in cudalab.memory._snapshot(allocators=[a])["segments"]
              for b in s["blocks"]]
    assert all(b["frames"] == [] for b in blocks)


@pytest.mark.parametrize("stacks", ["python", "all"])
def test_stacks_python_and_all_are_the_same_python_frames(priv, stacks):
    a = priv()
    cudalab.memory._record_memory_history(stacks=stacks)
    p, ln = a.malloc(2048, 0), line()
    (e,) = [e for e in trace({p}) if e["action"] == "alloc"]
    assert top(e["frames"])[1] == ln
    assert all(f["filename"] != "??" for f in e["frames"])


def test_state_keeps_block_stacks_and_a_single_trace_entry(priv):
    a = priv()
    cudalab.memory._record_memory_history("state")
    assert history.history_settings()["max_entries"] == 1
    p, ln = a.malloc(1000, 0), line()
    q = a.malloc(3000, 0)
    assert len(history.trace_entries(0)) == 1  # torch: max_entries forced to 1
    segs = cudalab.memory.memory_snapshot()  # process allocators: nothing of ours
    assert all(b["address"] not in (p, q) for s in segs for b in s["blocks"])
    blocks = {b["address"]: b for s in cudalab.memory._snapshot(allocators=[a])["segments"]
              for b in s["blocks"]}
    assert top(blocks[p]["frames"])[1] == ln and top(blocks[q]["frames"])[1] == ln + 1


def test_ring_buffer_keeps_the_newest_entries_in_order(priv):
    a = priv()
    cudalab.memory._record_memory_history(max_entries=7, context=None)
    sizes = [1000 + 512 * i for i in range(10)]
    for n in sizes:
        a.free(a.malloc(n, 0))
    expected = []
    for n in sizes:
        expected += [("alloc", n), ("free_requested", n), ("free_completed", n)]
    got = acts(history.trace_entries(0))
    assert got == expected[-7:]
    assert len(history.raw_entries(0)) == 7
    # growing the ring keeps what it holds; shrinking keeps the newest
    cudalab.memory._record_memory_history(max_entries=100, context=None)
    assert acts(history.trace_entries(0)) == expected[-7:]
    cudalab.memory._record_memory_history(max_entries=2, context=None)
    assert acts(history.trace_entries(0)) == expected[-2:]
    cudalab.memory._record_memory_history(max_entries=0, context=None)  # torch: at least 1
    assert acts(history.trace_entries(0)) == expected[-1:]


def test_clear_history_and_skip_actions(priv):
    a = priv()
    cudalab.memory._record_memory_history(context=None)
    a.free(a.malloc(1000, 0))
    assert len(history.trace_entries(0)) >= 3
    cudalab.memory._record_memory_history(context=None)  # reconfigure: history kept
    assert len(history.trace_entries(0)) >= 3
    cudalab.memory._record_memory_history(context=None, clear_history=True,
                                          skip_actions=["free_requested"])
    assert history.trace_entries(0) == []
    a.free(a.malloc(1000, 0))
    assert [e["action"] for e in history.trace_entries(0)] == ["alloc", "free_completed"]


def test_off_drops_the_history_and_costs_nothing(priv):
    cudalab.init()
    glob = cudalab.memory.get_allocator(0)
    a = priv()
    assert glob._trace is None and a._trace is None
    cudalab.memory._record_memory_history()
    assert glob._trace is not None and a._trace is not None
    a.free(a.malloc(1000, 0))
    cudalab.memory._record_memory_history(None)
    assert glob._trace is None and a._trace is None
    assert history.trace_entries(0) == [] and not history.is_recording()
    assert history.history_settings() is None
    a.free(a.malloc(1000, 0))
    assert history.trace_entries(0) == []


def test_legacy_bool_signature():
    cudalab.memory._record_memory_history(True)
    assert history.history_settings() == {"enabled": "all", "context": "state",
                                          "stacks": "python", "max_entries": 1,
                                          "skip_actions": []}
    cudalab.memory._record_memory_history(True, trace_alloc_max_entries=50,
                                          trace_alloc_record_context=True)
    st = history.history_settings()
    assert st["context"] == "alloc" and st["max_entries"] == 50
    cudalab.memory._record_memory_history(True, record_context=False)
    assert history.history_settings()["context"] is None
    cudalab.memory._record_memory_history(False)
    assert history.history_settings() is None


@pytest.mark.parametrize("kwargs, name", [
    ({"enabled": "yes"}, "enabled"),
    ({"enabled": 1}, "enabled"),
    ({"context": "free"}, "context"),
    ({"stacks": "cpp"}, "stacks"),
    ({"max_entries": -1}, "max_entries"),
    ({"max_entries": 1.5}, "max_entries"),
    ({"max_entries": True}, "max_entries"),
    ({"skip_actions": ["malloc"]}, "skip_actions"),
])
def test_bad_values_raise_and_change_nothing(priv, kwargs, name):
    a = priv()
    with pytest.raises(ValueError, match=name) as info:
        cudalab.memory._record_memory_history(**kwargs)
    if name in ("enabled", "context", "stacks"):
        assert "'all'" in str(info.value)  # the allowed values are listed
    assert a._trace is None and not history.is_recording()
    cudalab.memory._record_memory_history(context="alloc", max_entries=10)
    before = history.history_settings()
    trace_fn = a._trace
    with pytest.raises(ValueError, match=name):
        cudalab.memory._record_memory_history(**kwargs)
    assert history.history_settings() == before and a._trace is trace_fn


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        cudalab.memory._record_memory_history(colour="red")
    assert not history.is_recording()


def test_async_backend_refuses_recording(monkeypatch, backend):
    from cudalab.allocator.async_allocator import AsyncPoolAllocator

    monkeypatch.setattr(A, "_config", parse_alloc_conf("backend:cudaMallocAsync"))
    with pytest.raises(RuntimeError, match="cudaMallocAsync"):
        cudalab.memory._record_memory_history()
    assert not history.is_recording()
    monkeypatch.setattr(A, "_config", None)
    a = AsyncPoolAllocator(backend, 0, parse_alloc_conf("backend:cudaMallocAsync"),
                           stream_resolver=lambda: 0)
    try:
        cudalab.memory._record_memory_history()
        with pytest.raises(RuntimeError, match="cudaMallocAsync"):
            history.attach_allocator(a)
        assert a not in history._extra and history.is_recording()
    finally:
        a.close()


# --------------------------------------------------------------------------- registry
def test_allocators_created_later_are_recorded_on_every_device():
    cudalab.init()
    devs = list(range(min(2, cudalab.device_count())))
    saved_allocs, saved_active = list(A.allocators), list(A.active)
    A.allocators[:] = []
    A.active[:] = []
    made = []
    try:
        cudalab.memory._record_memory_history()
        for dev in devs:
            a = A.get_allocator(dev)  # created after recording started
            made.append(a)
            assert a._trace is not None
            p, ln = a.malloc(1000, 0), line()
            a.free(p)
            es = [e for e in history.trace_entries(dev) if e.get("addr") == p]
            assert "alloc" in [e["action"] for e in es]
            assert all(e["device"] == dev for e in es)
            assert top(es[1]["frames"])[1] == ln
        snap = cudalab.memory._snapshot()
        assert len(snap["device_traces"]) == cudalab.device_count()
        for dev in devs:
            assert any(e["action"] == "alloc" for e in snap["device_traces"][dev])
        cudalab.memory._record_memory_history(None)
        assert all(a._trace is None for a in made)
    finally:
        for a in made:
            a.empty_cache()
        A.allocators[:] = saved_allocs
        A.active[:] = saved_active


def test_threads_record_into_the_device_ring(priv):
    a = priv()
    cudalab.memory._record_memory_history(context="all")

    def work():
        for _ in range(200):
            a.free(a.malloc(1000, 0))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    es = [e for e in history.trace_entries(0) if e["action"] in ("alloc", "free_completed")]
    assert sum(e["action"] == "alloc" for e in es) == 800
    assert sum(e["action"] == "free_completed" for e in es) == 800
    assert all(e["frames"] and e["frames"][0]["name"] == "work" for e in es)


# --------------------------------------------------------------------------- context
def test_nvtx_range_is_recorded(priv):
    a = priv()
    cudalab.memory._record_memory_history(context=None)
    p0 = a.malloc(1000, 0)
    with cudalab.nvtx.range("outer"):
        p1 = a.malloc(1500, 0)
        with cudalab.nvtx.range("step {}", 3):
            p2 = a.malloc(2000, 0)
    p3 = a.malloc(2500, 0)
    got = {e["addr"]: e["nvtx_range"] for e in history.trace_entries(0)
           if e["action"] == "alloc"}
    assert got == {p0: None, p1: "outer", p2: "step 3", p3: None}


def test_nvtx_lookup_is_skipped_while_no_range_was_ever_pushed(priv, monkeypatch):
    """While ``cudalab.nvtx.ranges_used`` is False the history skips the thread-local lookup."""
    a = priv()
    monkeypatch.setattr(cudalab.nvtx, "ranges_used", False)
    cudalab.memory._record_memory_history(context=None)
    with cudalab.nvtx.range("r"):
        cudalab.nvtx.ranges_used = False  # (as if the range had never been pushed)
        p = a.malloc(1000, 0)
        cudalab.nvtx.ranges_used = True
        q = a.malloc(1500, 0)
    got = {e["addr"]: e["nvtx_range"] for e in trace({p, q}) if e["action"] == "alloc"}
    assert got == {p: None, q: "r"}


def test_nvtx_range_of_another_thread_is_not_seen(priv):
    a = priv()
    cudalab.memory._record_memory_history(context=None)
    out = []
    with cudalab.nvtx.range("main"):
        t = threading.Thread(target=lambda: out.append(a.malloc(1000, 0)))
        t.start()
        t.join()
    (e,) = [e for e in history.trace_entries(0) if e["addr"] == out[0]
            and e["action"] == "alloc"]
    assert e["nvtx_range"] is None


def test_cell_id_is_recorded(priv):
    a = priv()
    cudalab.memory._record_memory_history(context=None)
    p = a.malloc(1000, 0)
    history.set_current_cell("cell-7")
    assert history.current_cell() == "cell-7"
    q = a.malloc(1500, 0)
    history.set_current_cell(None)
    r = a.malloc(2000, 0)
    got = {e["addr"]: e["cell"] for e in history.trace_entries(0) if e["action"] == "alloc"}
    assert got == {p: None, q: "cell-7", r: None}


def test_memo_pairs_logged_as_times_keep_their_cell_and_nvtx_range(priv, monkeypatch):
    """Without stacks the allocator logs memo pairs as bare times; a cell change and the
    first NVTX range write them out first, so every entry keeps its own cell and range."""
    a = priv()
    s = cudalab.default_stream(0)  # a Stream object: the memo's pure hits
    monkeypatch.setattr(cudalab.nvtx, "ranges_used", False)
    cudalab.memory._record_memory_history(context=None)
    a.free(a.malloc(64, s))
    history.set_current_cell("c1")
    for _ in range(4):
        a.free(a.malloc(4096, s))
    assert a._hit_log  # pairs waiting as times
    history.set_current_cell("c2")
    assert not a._hit_log  # written out under the old cell
    for _ in range(4):
        a.free(a.malloc(4096, s))
    with cudalab.nvtx.range("r"):
        for _ in range(4):
            a.free(a.malloc(4096, s))
        assert a._hit_log is None  # with NVTX in use pairs are traced one entry at a time
    got = [(e["action"], e["cell"], e["nvtx_range"]) for e in trace() if e["size"] == 4096]
    pair = ("alloc", "free_requested", "free_completed")
    assert got == ([(x, "c1", None) for x in pair] * 4 + [(x, "c2", None) for x in pair] * 4
                   + [(x, "c2", "r") for x in pair] * 4)
    times = [e["time_us"] for e in trace()]
    assert times == sorted(times)


# --------------------------------------------------------------------------- context manager
def test_record_history_is_a_context_manager(priv):
    a = priv()
    with cudalab.memory.record_history(max_entries=1000) as rec:
        assert isinstance(rec, cudalab.memory.HistoryRecording)
        assert a._trace is not None
        p = a.malloc(1000, 0)
        a.free(p)
    assert a._trace is None and not history.is_recording()
    # what was recorded stays readable after the block ...
    assert [e["action"] for e in trace({p})] == ["segment_alloc", "alloc", "free_requested",
                                                  "free_completed"]
    snap = cudalab.memory._snapshot(allocators=[a])
    assert any(e["action"] == "alloc" for e in snap["device_traces"][0])
    assert not any(e["action"] == "snapshot" for e in snap["device_traces"][0])  # off
    # ... until recording is turned on again (a fresh history, as torch after an off)
    cudalab.memory._record_memory_history()
    assert history.trace_entries(0) == []


def test_nested_record_history_restores_the_outer_settings(priv):
    a = priv()
    cudalab.memory._record_memory_history(context="all", max_entries=500)
    outer = history.history_settings()
    with cudalab.memory.record_history(context=None, max_entries=500):
        p = a.malloc(1000, 0)
    assert history.history_settings() == outer
    q = a.malloc(1000, 0)
    es = {e["addr"]: e for e in history.trace_entries(0) if e["action"] == "alloc"}
    assert es[p]["frames"] == [] and es[q]["frames"] != []
    # record_history() without a with-block is the plain function
    rec = cudalab.memory.record_history(None)
    assert not history.is_recording()
    rec.restore()
    assert history.history_settings() == outer


def test_record_history_restores_after_an_exception(priv):
    a = priv()
    with pytest.raises(KeyError):
        with cudalab.memory.record_history():
            a.malloc(1000, 0)
            raise KeyError("boom")
    assert a._trace is None and not history.is_recording()


@pytest.mark.parametrize("context", [None, "state", "alloc", "all"])
def test_the_recorder_hook_implements_the_allocator_hook_protocol(priv, context):
    """The hook the recorder attaches is a ``cudalab.allocator.hooks.CompactTrace``: it
    has every field of the protocol (so a field renamed in hooks.py fails here, not as a
    silently slower recording), and it is attached through ``hooks.attach_trace``."""
    from cudalab.allocator import hooks

    fields = set(hooks.CompactTrace.__annotations__)
    assert fields == {"compact", "compact_ok", "now", "free_now", "capacity", "new_log"}
    assert set(hooks.TRACE_ACTIONS) <= set(history.ACTIONS)
    a = priv()
    cudalab.memory._record_memory_history("all", context=context, max_entries=123)
    trace = a._trace
    assert callable(trace)
    for name in fields:
        assert hasattr(trace, name), name
    assert callable(trace.compact) and callable(trace.now) and callable(trace.free_now)
    assert trace.compact_ok() in (True, False) and trace.capacity == 123
    log = trace.new_log(6)  # a StampLog: bounded, oldest first
    for i in range(5):
        log.append(i)
    assert list(log) == [0, 1, 2, 3, 4][-len(log):] and 4 <= len(log) <= 6
    stamp = trace.now()  # a time without stacks, else (time, stack)
    if context is None:
        assert isinstance(stamp, int) and stamp > 0
    else:
        assert isinstance(stamp, tuple) and len(stamp) == 2 and stamp[0] > 0
    cudalab.memory._record_memory_history(None)
    assert a._trace is None  # detached through hooks.detach_trace
