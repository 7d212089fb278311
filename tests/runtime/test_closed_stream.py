"""A closed Stream is refused, with an error that names it, wherever work would be queued on
it or waited for; memory already on its way (record_stream uses) is still given back."""

from __future__ import annotations

import gc
import re

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.allocator.config import parse_alloc_conf
from cudalab.allocator.registry import create_allocator


def closed_stream() -> cudalab.Stream:
    s = cudalab.Stream()
    s.close()
    return s


def refused(s: cudalab.Stream):
    """pytest.raises for the closed stream's error, naming ``s`` by its handle."""
    return pytest.raises(RuntimeError, match=rf"cuda_stream={s.cuda_stream:#x}> was closed")


def _record_on(s: cudalab.Stream) -> None:
    a = cudalab.empty(4)  # (kept alive while its pointer is in use)
    cm.record_stream(a.data_ptr(), s)


OPERATIONS = {
    "query": lambda s: s.query(),
    "synchronize": lambda s: s.synchronize(),
    "record_event": lambda s: s.record_event(),
    "record_event(Event)": lambda s: s.record_event(cudalab.Event()),
    "wait_event (recorded)": lambda s: s.wait_event(cudalab.Event().record()),
    "wait_event (never recorded)": lambda s: s.wait_event(cudalab.Event()),
    "wait_stream": lambda s: s.wait_stream(cudalab.current_stream()),
    "wait_stream on it": lambda s: cudalab.current_stream().wait_stream(s),
    "Event.record": lambda s: cudalab.Event().record(s),
    "Event.record (existing event)": lambda s: cudalab.Event().record().record(s),
    "Event.wait": lambda s: cudalab.Event().record().wait(s),
    "priority": lambda s: s.priority,
    "set_stream": lambda s: cudalab.set_stream(s),
    "with stream": lambda s: s.__enter__(),
    "cudalab.stream()": lambda s: cudalab.stream(s).__enter__(),
    "caching_allocator_alloc": lambda s: cm.caching_allocator_alloc(4096, stream=s),
    "record_stream": lambda s: _record_on(s),
    "DeviceArray.record_stream": lambda s: cudalab.empty(4).record_stream(s),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_closed_stream_is_refused(name):
    s = closed_stream()
    before = cudalab.current_stream()
    with refused(s):
        OPERATIONS[name](s)
    assert cudalab.current_stream() is before  # nothing was made current
    cudalab.synchronize()


def test_the_allocators_memo_does_not_outlive_the_stream():
    """A malloc/free loop on a stream sets up the allocator's fast path for that stream
    object; closing the stream must end it (a pure memo hit checks nothing else)."""
    s = cudalab.Stream()
    for _ in range(4):
        cm.caching_allocator_delete(cm.caching_allocator_alloc(1000, stream=s))
    s.close()
    with refused(s):
        cm.caching_allocator_alloc(1000, stream=s)
    cm.caching_allocator_delete(cm.caching_allocator_alloc(1000))  # the allocator is fine


@pytest.mark.parametrize("conf", ["expandable_segments:True", "backend:cudaMallocAsync", ""])
def test_every_allocator_refuses_a_closed_stream(backend, conf):
    a = create_allocator(backend, 0, parse_alloc_conf(conf), no_caching=False)
    s = cudalab.Stream()
    try:
        a.free(a.malloc(4096, s))
        s.close()
        with refused(s):
            a.malloc(4096, s)
        p = a.malloc(4096)
        with refused(s):
            a.record_stream(p, s)
        a.free(p)
    finally:
        a.empty_cache()


def test_no_caching_refuses_a_closed_stream(backend):
    a = create_allocator(backend, 0, parse_alloc_conf(""), no_caching=True)
    s = closed_stream()
    with refused(s):
        a.malloc(4096, s)


def test_a_block_used_on_a_stream_closed_later_is_still_freed():
    """record_stream, then close the stream, then free: the free waits for the device
    instead of recording an event on the closed stream, and the block comes back."""
    s = cudalab.Stream()
    p = cm.caching_allocator_alloc(1 << 20)
    cm.record_stream(p, s)
    s.close()
    cm.caching_allocator_delete(p)  # no error
    cudalab.synchronize()
    stats = cm.memory_stats()
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]


def test_a_closed_stream_stays_an_ordinary_object():
    s = cudalab.Stream()
    key = hash(s)
    s.close()
    s.close()  # idempotent
    assert s.closed and isinstance(s, cudalab.Stream) and hash(s) == key and s == s
    assert re.fullmatch(r"<cudalab\.Stream device=cuda:0 cuda_stream=0x[0-9a-f]+ closed>", repr(s))
    assert s.device_index == 0 and s.device == cudalab.Device("cuda", 0)
    assert not cudalab.Stream().closed and not cudalab.current_stream().closed
    del s
    gc.collect()  # its finalizer does not release the handle a second time


def test_an_open_stream_still_works_everywhere():
    s = cudalab.Stream()
    with s:
        assert cudalab.current_stream() is s
        ev = cudalab.Event().record()
    s.wait_event(ev)
    cudalab.current_stream().wait_stream(s)
    p = cm.caching_allocator_alloc(4096, stream=s)
    cm.record_stream(p, cudalab.current_stream())
    cm.caching_allocator_delete(p)
    s.synchronize()
    assert s.query()
