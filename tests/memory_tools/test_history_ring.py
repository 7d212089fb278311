"""The history's ring buffer in columns (``cudalab.memory_tools.history_ring``): torch's
``max_entries`` semantics (oldest dropped, read back oldest to newest) whatever the
compaction points, entries read back as appended, nothing tracked by the garbage collector
per stored entry, and a bounded memory per entry over a long recording."""

from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest

import cudalab
from cudalab.memory_tools import history, history_ring
from cudalab.memory_tools.history_ring import CHUNK, HistoryRing


def entry(i: int, frames=None, nvtx=None, cell=None, *meta) -> tuple:
    return (history.ACTIONS[i % len(history.ACTIONS)], 0x7F0000000000 + 512 * i, 4096 + i,
            i % 3, 1_700_000_000_000_000_000 + i, frames, nvtx, cell, *meta)


@pytest.fixture(autouse=True)
def _history_off():
    cudalab.memory._record_memory_history(None)
    history.set_current_cell(None)
    yield
    cudalab.memory._record_memory_history(None)
    history.set_current_cell(None)


@pytest.mark.parametrize("maxlen", [1, 3, 10, CHUNK - 1, CHUNK + 5])
@pytest.mark.parametrize("every", [1, 7, CHUNK, None])
def test_ring_keeps_the_newest_maxlen_entries_oldest_first(maxlen, every):
    """Whatever the points at which young entries move into columns, the ring holds the
    newest ``maxlen`` entries, oldest first (torch's ring: the oldest is overwritten)."""
    ring = HistoryRing(maxlen)
    appended = []
    for i in range(2 * CHUNK + 123):
        e = entry(i)
        ring.young.append(e)
        appended.append(e)
        if every is not None and i % every == 0:
            ring.compact()
        if i in (0, maxlen - 1, maxlen, CHUNK + 1):
            assert ring.entries() == appended[-maxlen:]
    assert ring.entries() == appended[-maxlen:]
    assert len(ring) == min(maxlen, len(appended))
    ring.compact()
    assert ring.entries() == appended[-maxlen:]


def test_entries_read_back_as_appended():
    """Frames (the same objects), NVTX ranges, cells and user metadata come back as they
    were appended; an entry without metadata keeps its eight fields."""
    stack_a = (test_entries_read_back_as_appended.__code__, 10)
    stack_b = (entry.__code__, 4, stack_a[0], 12)
    appended = [entry(0), entry(1, stack_a, "fwd", "cell-1"), entry(2, stack_b, None, "c2"),
                entry(3, stack_a, "fwd", None, "meta"), entry(4, None, None, None, ""),
                entry(5, stack_b)]
    ring = HistoryRing(100)
    for e in appended:
        ring.append(e)
    ring.compact()
    got = ring.entries()
    assert got == [e if len(e) == 8 or e[8] else e[:8] for e in appended]
    assert got[1][5] is stack_a and got[2][5] is stack_b and got[5][5] is stack_b
    assert [len(e) for e in got] == [8, 8, 8, 9, 8, 8]
    assert ring.nbytes() > 0


@pytest.mark.parametrize("odd", [
    ("alloc", 2**70, 1, 0, 1, None, None, None),  # beyond 64 bits
    ("not an action", 1, 1, 0, 1, None, None, None),
    ("alloc", 1, 1, 0, 1, None, ["unhashable"], None),
])
def test_entries_the_columns_cannot_hold_are_kept_as_tuples(odd):
    ring = HistoryRing(10)
    appended = [entry(1), odd, entry(2)]
    for e in appended:
        ring.append(e)
    ring.compact()
    assert ring.entries() == appended


def test_growing_the_ring_brings_back_nothing_dropped():
    ring = HistoryRing(5)
    appended = [entry(i) for i in range(12)]
    for e in appended:
        ring.young.append(e)  # (not compacted yet: young holds more than maxlen)
    ring.set_maxlen(100)
    assert ring.entries() == appended[-5:]
    ring.set_maxlen(2)
    assert ring.entries() == appended[-2:]


def test_bad_maxlen_raises():
    with pytest.raises(ValueError, match="maxlen"):
        HistoryRing(0)
    with pytest.raises(ValueError, match="maxlen"):
        HistoryRing(2.5)  # type: ignore[arg-type]


def test_stacks_of_dropped_entries_are_freed():
    """The frames table keeps a stack only while an entry in the ring refers to it: a ring
    of 100 entries over 20,000 distinct stacks keeps a bounded table."""
    ring = HistoryRing(100)
    for i in range(20_000):
        ring.append(entry(i, (entry.__code__, i), f"range {i}"))
    ring.compact()
    assert len(ring._frames.values) <= 2 * history_ring._TABLE_MIN + CHUNK
    assert len(ring._strings.values) <= 2 * history_ring._TABLE_MIN + CHUNK
    got = ring.entries()
    assert [e[5][1] for e in got] == list(range(19_900, 20_000))
    assert got[-1][6] == "range 19999"


def _record_pairs(pairs: int) -> None:
    x = None
    for _ in range(pairs):
        x = cudalab.empty(1024)
        del x
    history._sync_allocators()


def test_recorder_ring_wraps_at_max_entries_over_chunks():
    """Through the recorder: max_entries over several chunks keeps the newest entries,
    in time order, ending with the last pair's."""
    cap = CHUNK + 1000
    cudalab.memory._record_memory_history("all", stacks="python", max_entries=cap)
    _record_pairs(2 * CHUNK)
    got = history.raw_entries(0)
    assert len(got) == cap
    times = [e[4] for e in got]
    assert times == sorted(times)
    assert [e[0] for e in got[-3:]] == ["alloc", "free_requested", "free_completed"]
    assert all(e[5] for e in got if e[0] == "alloc")  # stacks kept through the columns
    assert len(history.trace_entries(0)) == cap


def test_stored_entries_are_not_tracked_by_the_garbage_collector():
    """The objects the garbage collector tracks do not grow with the recorded entries
    (a full collection would otherwise traverse every one of them)."""
    cudalab.memory._record_memory_history("all", stacks="python", max_entries=sys.maxsize)
    _record_pairs(2 * CHUNK)
    gc.collect()
    before = len(gc.get_objects())
    _record_pairs(6 * CHUNK)  # 18 more chunks of entries
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert len(history._rings[0]) >= 24 * CHUNK
    assert grown < CHUNK // 4, grown
    # every chunk is columns: a few arrays per CHUNK entries, no object per entry
    assert all(c[0] == history_ring._COLUMNS for c in history._rings[0]._chunks)


def test_memory_per_recorded_entry_is_bounded():
    """A long recording costs at most 64 bytes per entry (a tuple per entry cost ~136)."""
    cudalab.memory._record_memory_history("all", stacks="python", max_entries=sys.maxsize)
    _record_pairs(1000)
    gc.collect()
    tracemalloc.start()
    try:
        m0 = tracemalloc.get_traced_memory()[0]
        n0 = len(history._rings[0])
        _record_pairs(5 * CHUNK)
        gc.collect()
        m1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_entry = (m1 - m0) / (len(history._rings[0]) - n0)
    assert per_entry <= 64, per_entry
