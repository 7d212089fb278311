"""The allocator's pair memo (deferred free of an alloc+free pair) changes nothing observable.

Two native allocators over two identical private simulators run the same operations, one
with the memo and one without: every pointer, every ``memory_stats`` value and every
segment/block of the snapshot must be equal, whenever they are read and at the end.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import parse_alloc_conf
from cudalab.allocator.hooks import attach_trace

KiB = 1024
MiB = 1024 * 1024
SIZES = [1, 512, 700, 4 * KiB, 1 * MiB, 1 * MiB + 1, 3 * MiB, 3 * MiB + 100, 12 * MiB, 21 * MiB]


def _pair(monkeypatch, conf=""):
    import cudalab
    from cudalab._driver.sim import SimulatorBackend

    cudalab.init()  # the process's own backend (for "s0"/"s1"), before the private sims' settings
    monkeypatch.setenv("CUDALAB_SIMULATOR_MEMORY", "4GiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = []
    for memo in (True, False):
        sim = SimulatorBackend()
        sim.init()
        a = DeviceCachingAllocator(sim, 0, parse_alloc_conf(conf), stream_resolver=lambda: 0)
        a._memo_ok = a._memo_ok and memo
        out.append(a)
    return out


def _segments(a):
    return [{**seg, "blocks": [dict(b) for b in seg["blocks"]]} for seg in a.segments()]


_STREAMS: dict = {}


def _stream(token):
    """Stream arguments: ints as they are; "s0"/"s1" name two cudalab.Stream objects (the
    pure memo hit matches the Stream object itself, so objects and their ints are mixed)."""
    if not isinstance(token, str):
        return token
    s = _STREAMS.get(token)
    if s is None:
        import cudalab

        s = _STREAMS[token] = cudalab.default_stream(0) if token == "s0" else cudalab.Stream()
    return s


class _Runner:
    def __init__(self, allocs):
        self.allocs = allocs
        self.live: list[list[int]] = []  # per live allocation: its pointer in each allocator

    def malloc(self, size, stream):
        stream = _stream(stream)
        ptrs = [a.malloc(size, stream) for a in self.allocs]
        assert ptrs[0] == ptrs[1]
        self.live.append(ptrs)

    def free(self, i):
        if self.live:
            ptrs = self.live.pop(i % len(self.live))
            for a, p in zip(self.allocs, ptrs):
                a.free(p)

    def compare(self):
        s0, s1 = (a.memory_stats() for a in self.allocs)
        assert s0 == s1
        assert _segments(self.allocs[0]) == _segments(self.allocs[1])


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), st.sampled_from(SIZES), st.sampled_from([0, 7, "s0", "s1"])),
        st.tuples(st.just("pairs"), st.sampled_from(SIZES), st.integers(1, 5),
                  st.sampled_from([0, 7, "s0", "s1"]), st.integers(0, 600)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("free_last")),
        st.tuples(st.just("compare")),
        st.tuples(st.just("reset_peak")),
        st.tuples(st.just("reset_acc")),
        st.tuples(st.just("empty_cache")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:4"])
@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_memo_is_invisible(monkeypatch, conf, ops):
    r = _Runner(_pair(monkeypatch, conf))
    for op in ops:
        kind = op[0]
        if kind == "malloc":
            r.malloc(op[1], op[2])
        elif kind == "pairs":  # alloc/free loops, sizes varying inside one rounding bucket
            _, size, n, stream, jitter = op
            for i in range(n):
                r.malloc(max(1, size - (i * jitter) % 512), stream)
                r.free(len(r.live) - 1)
        elif kind == "free":
            r.free(op[1])
        elif kind == "free_last":
            r.free(len(r.live) - 1)
        elif kind == "compare":
            r.compare()
        elif kind == "reset_peak":
            for a in r.allocs:
                a.reset_peak_stats()
        elif kind == "reset_acc":
            for a in r.allocs:
                a.reset_accumulated_stats()
        else:
            for a in r.allocs:
                a.empty_cache()
    r.compare()
    for a in r.allocs:
        a.check_invariants()


def test_memo_hits_and_a_hit_left_out(monkeypatch):
    """Many pairs, with the last hit still allocated when the counters are read."""
    r = _Runner(_pair(monkeypatch))
    r.malloc(3 * MiB, 0)  # something else alive in the large pool
    for i in range(1000):
        r.malloc(1000 + i % 24, 0)
        r.free(len(r.live) - 1)
    assert r.allocs[0].memo_block is not None and r.allocs[0]._memo_hits > 990
    assert r.allocs[1].memo_block is None
    r.malloc(1500, 0)  # a hit that stays out
    r.compare()
    s = r.allocs[0].memory_stats()
    assert s["allocation.all.allocated"] == 1002
    assert s["requested_bytes.all.peak"] == 3 * MiB + 1500  # the hit still out
    r.free(0)
    r.free(0)
    r.compare()


@pytest.mark.parametrize("stream", [0, "s0", "s1"])
def test_pure_and_general_hits_interleave(monkeypatch, stream):
    """Requests that return to the memo's first size after other sizes of the same bucket
    (the pure hit must then see what the general hits left on the block and remainder)."""
    sizes = (4096, 4000, 4096, 4096, 3900, 3900, 4096, 4095, 4096)
    for k in range(1, len(sizes) + 1):
        r = _Runner(_pair(monkeypatch))
        r.malloc(64, stream)  # a segment to carve from (a fresh segment sets up no memo)
        r.free(0)
        for size in sizes[:k]:  # pairs with the memo live throughout (no read in between)
            r.malloc(size, stream)
            r.free(len(r.live) - 1)
        assert r.allocs[0].memo_block is not None
        r.malloc(4096, stream)  # a hit that stays out
        r.compare()
        r.free(0)
        r.compare()


def test_memo_is_flushed_before_history_records(monkeypatch):
    import cudalab.memory as cm

    (a, b) = _pair(monkeypatch)
    for _ in range(3):
        a.free(a.malloc(4096, 0))
    assert a.memo_block is not None
    a.sync_pending()
    assert a.memo_block is None
    a.check_invariants()
    assert a.memory_stats()["allocation.all.allocated"] == 3
    assert cm  # the public getters call sync_pending (tests/allocator/test_allocator_stats.py)


def test_double_free_of_a_memo_block_is_refused(monkeypatch):
    (a, _) = _pair(monkeypatch)
    p = a.malloc(4096, 0)
    a.free(p)
    p = a.malloc(4096, 0)
    a.free(p)  # deferred
    with pytest.raises(ValueError, match="double free or foreign pointer"):
        a.free(p)
    a.check_invariants()
    assert a.memory_stats()["allocation.all.current"] == 0


def test_pure_hits_follow_the_stream_argument_and_the_current_stream():
    """A pure hit needs the very Stream the memo was set up on: an explicit other stream,
    or None while another stream is current, must take the plain path."""
    import cudalab
    from cudalab.allocator.registry import get_allocator

    cudalab.init()
    a = get_allocator(0)
    a.sync_pending()
    base = a.memory_stats()["allocation.all.allocated"]
    s = cudalab.Stream()
    for _ in range(3):
        a.free(a.malloc(4096))  # on the current (default) stream
    p = a.malloc(4096)
    assert a._memo_hits >= 1
    a.free(p)
    with cudalab.stream(s):
        q = a.malloc(4096)  # current stream s: never the default stream's memo block
    r = a.malloc(4096, s)
    segs = {seg["address"]: seg for seg in a.segments()}
    for ptr in (q, r):
        seg = next(g for g in segs.values() if g["address"] <= ptr < g["address"] + g["total_size"])
        assert seg["stream"] == s.cuda_stream
    assert p not in (q, r)
    a.free(q)
    a.free(r)
    assert a.memory_stats()["allocation.all.allocated"] == base + 6
    a.check_invariants()


class _CountingTLS:
    """Stands in for the allocator's thread-local: counts reads of ``.streams``."""

    def __init__(self, tls):
        self.reads = 0
        self._tls = tls

    @property
    def streams(self):
        self.reads += 1
        return self._tls.streams


def test_default_stream_pure_hits_skip_the_thread_local(monkeypatch, two_devices):
    """While no thread has a stream other than the default current, stream=None pure hits
    read no thread-local; once one has, they look the current stream up again."""
    import cudalab
    from cudalab import streams
    from cudalab.allocator import caching as A
    from cudalab.allocator.registry import get_allocator

    cudalab.init()
    a = get_allocator(0)
    assert streams.custom_stream_tokens == []
    for _ in range(3):
        a.free(a.malloc(4096))
    assert a._hit_none
    spy = _CountingTLS(A._tls)
    monkeypatch.setattr(A, "_tls", spy)
    hits = a._memo_hits
    for _ in range(50):
        a.free(a.malloc(4096))
    assert a._memo_hits == hits + 50 and spy.reads == 0
    s1 = cudalab.Stream(1)
    with cudalab.stream(s1):  # device 1 has a stream of its own current
        with cudalab.stream(cudalab.default_stream(0)):  # device 0: the default stream
            assert streams.custom_stream_tokens
            p = a.malloc(4096)
    assert spy.reads >= 1 and a._memo_hits == hits + 51  # still the memo: stream 0 was current
    a.free(p)
    a.check_invariants()


def test_pure_hits_on_stream_none_respect_other_threads_streams():
    """Thread B, with its own stream current, asks for the size the main thread's memo
    serves on the default stream: it must get a block of B's stream, never the memo's."""
    import threading

    import cudalab
    from cudalab.allocator.registry import get_allocator

    cudalab.init()
    a = get_allocator(0)
    for _ in range(3):
        a.free(a.malloc(4096))
    assert a.memo_block is not None and a._hit_none
    memo_ptr = a.memo_block.ptr
    got, errors = [], []

    def b():
        try:
            s = cudalab.Stream()
            with cudalab.stream(s):
                p = a.malloc(4096)
                got.append((p, s.cuda_stream, a.live[p].fl.stream))
                a.free(p)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=b)
    t.start()
    t.join()
    assert not errors
    (p, key, on) = got[0]
    assert p != memo_ptr and on == key != 0
    q = a.malloc(4096)  # the main thread is still on the default stream
    assert a.live[q].fl.stream == 0
    a.free(q)
    a.check_invariants()


def test_public_getters_see_memo_hits():
    import cudalab
    import cudalab.memory as cm

    cudalab.init()
    base = cm.memory_allocated()
    for _ in range(5):
        cm.caching_allocator_delete(cm.caching_allocator_alloc(4096))
    p = cm.caching_allocator_alloc(4096)
    assert cm.memory_allocated() == base + 4096
    cm.caching_allocator_delete(p)
    assert cm.memory_allocated() == base


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_memo_records_the_same_history(monkeypatch, ops):
    """With a trace hook installed, the memo emits exactly the plain path's entries."""
    r = _Runner(_pair(monkeypatch))
    logs: list[list] = [[], []]
    for a, log in zip(r.allocs, logs):
        attach_trace(a, lambda *entry, log=log: log.append(entry))
    _run_history_ops(r, ops)
    assert logs[0] == logs[1]
    r.compare()


def _run_history_ops(r, ops):
    for op in ops:
        if op[0] == "malloc":
            r.malloc(op[1], op[2])
        elif op[0] == "pairs":
            for _ in range(op[2]):
                r.malloc(op[1], op[3])
                r.free(len(r.live) - 1)
        elif op[0] in ("free", "free_last"):
            r.free(op[1] if op[0] == "free" else len(r.live) - 1)
        elif op[0] == "empty_cache":
            for a in r.allocs:
                a.empty_cache()


def _history_traces(r, monkeypatch, level=None):
    """The history module's hook of context ``level`` (default: stack-less) on each
    allocator, each into its own list, and their recorders. No NVTX range was pushed as far
    as the hooks know (an earlier test may have pushed one), so the memo logs compactly."""
    from cudalab import nvtx
    from cudalab.memory_tools import history as h

    monkeypatch.setattr(nvtx, "ranges_used", False)
    logs: list[list] = [[], []]
    recs = [h._Recorder(0), h._Recorder(0)]
    for a, log, rec in zip(r.allocs, logs, recs):
        attach_trace(a, h._make_trace(rec, h._NEVER if level is None else level, log.append))
    return logs, recs


def _stackless_traces(r, monkeypatch):
    return _history_traces(r, monkeypatch)[0]


def _without_times(log):
    return [e[:4] + e[5:] for e in log]


def _run_and_write_out(r, ops, logs):
    """Run ``ops``, write out what the memo logged, and check both allocators' entries
    match (times aside) and the memo's are in time order."""
    _run_history_ops(r, ops)
    for a in r.allocs:
        a.sync_pending()
    assert _without_times(logs[0]) == _without_times(logs[1])
    times = [e[4] for e in logs[0]]
    assert times == sorted(times)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_pairs_logged_as_times_give_the_same_history(monkeypatch, ops):
    """With the history's stack-less hook the memo logs its pairs as bare times; once
    written out they are exactly the plain path's entries, in time order."""
    r = _Runner(_pair(monkeypatch))
    logs = _stackless_traces(r, monkeypatch)
    _run_and_write_out(r, ops, logs)
    r.compare()


@pytest.mark.parametrize("context", ["state", "alloc", "all"])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_pairs_logged_with_stacks_give_the_same_history(monkeypatch, context, ops):
    """With stacks the memo logs its pairs as (time, stack) stamps; once written out they
    are the plain path's entries, frames included, and the live blocks keep the same
    allocation stacks."""
    from cudalab.memory_tools import history as h

    r = _Runner(_pair(monkeypatch))
    logs, recs = _history_traces(r, monkeypatch, h._CONTEXTS[context])
    _run_and_write_out(r, ops, logs)
    assert recs[0].blocks == recs[1].blocks
    assert sorted(recs[0].blocks) == sorted(p for p, _ in r.live)
    stacks = [e[5] for e in logs[0] if e[0] == "alloc"]
    assert all(stacks) if context != "state" else not any(stacks)
    r.compare()


def test_pairs_are_logged_as_times_then_written_out(monkeypatch):
    r = _Runner(_pair(monkeypatch))
    logs = _stackless_traces(r, monkeypatch)
    r.malloc(64, "s0")
    r.free(0)
    for _ in range(50):
        r.malloc(4096, "s0")
        r.free(0)
    a = r.allocs[0]
    assert a._hit_log is not None and len(a._hit_log) >= 2 * 48  # logged, not yet written
    n = len(logs[0])
    assert a._ready  # the last pair's free is deferred: its time is on the block
    log = list(a._hit_log)  # (free time, alloc time) pairs, 0 for none
    assert len(log) % 2 == 0 and all(t > 0 for t in log[1::2])
    frees = [*log[0::2], a.memo_block.tfree]  # the last free's time is still on the block
    expected = 2 * sum(1 for t in frees if t) + len(log) // 2 + 1
    r.malloc(4000, "s0")  # a general hit: the logged pairs go first, then its own entry
    assert len(logs[0]) == n + expected and not a._hit_log
    assert [e[4] for e in logs[0][n:-1:]][:1] == [next(t for t in log if t)]
    written = logs[0][n:-1]
    assert [e[0] for e in written].count("alloc") == len(log) // 2
    assert logs[0][-1][0] == "alloc" and logs[0][-1][2] == 4000
    r.free(0)
    r.compare()
    assert _without_times(logs[0]) == _without_times(logs[1])
    actions = [e[0] for e in logs[0]]
    assert actions.count("alloc") == 52 and actions.count("free_completed") == 52


# --------------------------------------------------------------------------- the hook protocol
def test_trace_actions_and_the_hook_protocol(backend):
    """hooks.TRACE_ACTIONS names exactly TraceAction's values; an allocator reports only those
    to a hook attached with attach_trace, nothing after detach_trace; cudaMallocAsync refuses
    a hook and keeps none."""
    import typing

    from cudalab.allocator.async_allocator import AsyncPoolAllocator
    from cudalab.allocator.hooks import TRACE_ACTIONS, TraceAction, detach_trace
    from cudalab.allocator.registry import native_allocator

    assert typing.get_args(TraceAction) == TRACE_ACTIONS
    for conf in ("", "expandable_segments:True"):
        a = native_allocator(backend, 0, parse_alloc_conf(conf), stream_resolver=lambda: 0)
        seen: list[tuple] = []
        attach_trace(a, lambda *entry, ap=seen.append: ap(entry))
        for _ in range(3):
            a.free(a.malloc(3000))
        a.free(a.malloc(3 * MiB))
        a.empty_cache()
        detach_trace(a)
        assert a._trace is None
        n = len(seen)
        a.free(a.malloc(3000))
        a.empty_cache()
        assert len(seen) == n
        assert {e[0] for e in seen} <= set(TRACE_ACTIONS)
        assert [e[0] for e in seen[:2]] == ["segment_alloc" if not conf else "segment_map",
                                            "alloc"]
    aa = AsyncPoolAllocator(backend, 0, parse_alloc_conf("backend:cudaMallocAsync"),
                            stream_resolver=lambda: 0)
    try:
        with pytest.raises(RuntimeError, match="cudaMallocAsync"):
            attach_trace(aa, lambda *entry: None)
        assert aa._trace is None
    finally:
        aa.close()


def test_history_hook_has_the_compact_protocol(backend, monkeypatch):
    """The history recorder's hook provides every member of hooks.CompactTrace, so the
    allocator logs memo pairs as stamps (the two cannot drift apart unnoticed)."""
    import cudalab.memory
    from cudalab import nvtx
    from cudalab.allocator.hooks import CompactTrace
    from cudalab.allocator.registry import native_allocator
    from cudalab.memory_tools import history

    monkeypatch.setattr(nvtx, "ranges_used", False)  # as if no test had pushed a range
    a = native_allocator(backend, 0, parse_alloc_conf(""), stream_resolver=lambda: 0)
    cudalab.memory._record_memory_history("all", stacks="python")
    try:
        history.attach_allocator(a)
        trace = a._trace
        assert callable(trace)
        members = set(CompactTrace.__annotations__)
        assert members == {"compact", "compact_ok", "now", "free_now", "capacity", "new_log"}
        for name in members:
            assert hasattr(trace, name), name
        for _ in range(4):
            a.free(a.malloc(3000))
        assert a._hit_log is not None  # memo pairs are logged as stamps
    finally:
        history.detach_allocator(a)
        cudalab.memory._record_memory_history(None)
    assert a._trace is None
