"""A hypothesis state machine over the caching allocator.

Rules: malloc on one of four streams (sizes spread over both pools and the segment-size
boundaries), free, record_stream on another stream, empty_cache, event processing, and on
the simulator pausing/resuming streams so that record_stream frees stay pending. After every
step: blocks tile their segments exactly, allocated <= active <= reserved, and every
counter equals a recount from the block lists (``check_invariants`` plus the checks here on
the public snapshot and stats).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import parse_alloc_conf

KiB = 1024
MiB = 1024 * 1024

SIZES = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(4 * KiB, 1 * MiB + 4 * KiB),  # around the small/large boundary
    st.integers(1 * MiB, 12 * MiB),  # 20 MiB segments and the 10 MiB boundary
    st.sampled_from([512, 1 * MiB, 2 * MiB, 10 * MiB, 20 * MiB, 25 * MiB + 3]),
)


@pytest.fixture(scope="module")
def streams():
    import cudalab

    cudalab.init()
    return [cudalab.Stream() for _ in range(4)]


def make_machine(backend, streams, conf):
    pausable = hasattr(backend, "pause_stream")

    class AllocatorMachine(RuleBasedStateMachine):
        ptrs = Bundle("ptrs")

        def __init__(self):
            super().__init__()
            self.a = DeviceCachingAllocator(backend, 0, parse_alloc_conf(conf),
                                            stream_resolver=lambda: streams[0].cuda_stream)
            self.live: dict[int, int] = {}  # ptr -> requested size
            self.paused: set[int] = set()

        @rule(target=ptrs, size=SIZES, s=st.integers(0, 3))
        def malloc(self, size, s):
            p = self.a.malloc(size, streams[s])
            assert p not in self.live
            self.live[p] = size
            seg = next(g for g in self.a.segments()
                       if g["address"] <= p < g["address"] + g["total_size"])
            assert seg["stream"] == streams[s].cuda_stream  # never another stream's memory
            return p

        @rule(p=consumes(ptrs))
        def free(self, p):
            self.a.free(p)
            del self.live[p]

        @rule(p=ptrs, s=st.integers(0, 3))
        def record_stream(self, p, s):
            if p in self.live:
                self.a.record_stream(p, streams[s])

        @precondition(lambda self: pausable)
        @rule(s=st.integers(1, 3))
        def pause(self, s):
            backend.pause_stream(streams[s].handle)
            self.paused.add(s)

        @precondition(lambda self: self.paused)
        @rule(data=st.data())
        def resume(self, data):
            s = data.draw(st.sampled_from(sorted(self.paused)))
            backend.resume_stream(streams[s].handle)
            self.paused.discard(s)

        @rule()
        def process_events(self):
            self.a.process_events()

        @precondition(lambda self: not self.paused)
        @rule()
        def empty_cache(self):
            self.a.empty_cache()
            s = self.a.memory_stats()
            assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
            for seg in self.a.segments():  # only segments with live blocks survive
                assert seg["allocated_size"] > 0

        @invariant()
        def consistent(self):
            a = self.a
            a.check_invariants()
            s = a.memory_stats()
            segs = a.segments()
            recount = {k: 0 for k in ("alloc", "abytes", "active", "actbytes", "req", "segs",
                                      "res", "split", "splitbytes")}
            for seg in segs:
                addr = seg["address"]
                for b in seg["blocks"]:  # blocks tile the segment exactly
                    assert b["address"] == addr
                    addr += b["size"]
                assert addr == seg["address"] + seg["total_size"]
                recount["segs"] += 1
                recount["res"] += seg["total_size"]
                for b in seg["blocks"]:
                    if b["state"] == "active_allocated":
                        recount["alloc"] += 1
                        recount["abytes"] += b["size"]
                    if b["state"] != "inactive":
                        recount["active"] += 1
                        recount["actbytes"] += b["size"]
                        recount["req"] += b["requested_size"]
                    elif len(seg["blocks"]) > 1:
                        recount["split"] += 1
                        recount["splitbytes"] += b["size"]
            assert s["allocation.all.current"] == recount["alloc"] == len(self.live)
            assert s["allocated_bytes.all.current"] == recount["abytes"]
            assert s["active.all.current"] == recount["active"]
            assert s["active_bytes.all.current"] == recount["actbytes"]
            assert s["requested_bytes.all.current"] == recount["req"]
            assert s["segment.all.current"] == recount["segs"]
            assert s["reserved_bytes.all.current"] == recount["res"]
            assert s["inactive_split.all.current"] == recount["split"]
            assert s["inactive_split_bytes.all.current"] == recount["splitbytes"]
            assert s["allocated_bytes.all.current"] <= s["active_bytes.all.current"] \
                <= s["reserved_bytes.all.current"]
            for stat in ("allocation", "allocated_bytes", "active", "active_bytes", "segment",
                         "reserved_bytes", "inactive_split", "inactive_split_bytes",
                         "requested_bytes"):
                for m in ("current", "peak", "allocated", "freed"):
                    total = s[f"{stat}.small_pool.{m}"] + s[f"{stat}.large_pool.{m}"]
                    if m == "peak":
                        assert s[f"{stat}.all.peak"] <= total
                        assert s[f"{stat}.all.peak"] >= s[f"{stat}.all.current"]
                    else:
                        assert s[f"{stat}.all.{m}"] == total, (stat, m)
                for pool in ("all", "small_pool", "large_pool"):
                    q = {m: s[f"{stat}.{pool}.{m}"] for m in ("current", "peak", "allocated",
                                                             "freed")}
                    assert q["allocated"] - q["freed"] == q["current"], (stat, pool, q)
                    assert q["peak"] >= q["current"] >= 0
            sizes = {p: a.block_size(p) for p in self.live}
            for p, req in self.live.items():
                assert sizes[p] >= req

        def teardown(self):
            for s in list(self.paused):
                backend.resume_stream(streams[s].handle)
            for p in list(self.live):
                self.a.free(p)
            self.a.empty_cache()
            assert self.a.segments() == []
            assert self.a.memory_stats()["reserved_bytes.all.current"] == 0

    return AllocatorMachine


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:20", "roundup_power2_divisions:[1:4,8:2,>:8]"])
def test_allocator_state_machine(backend, streams, conf):
    machine = make_machine(backend, streams, conf)
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()
