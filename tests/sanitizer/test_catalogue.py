"""torch's CSAN race catalogue (test/test_cuda_sanitizer.py, TestEventHandler), ported.

torch drives its event handler with synthetic launches; here the launches are
:func:`cudalab.sanitizer.record_launch` calls on real cudalab streams, and the
synchronisation is cudalab's own: ``Event.record`` / ``Event.wait``, ``Event.close``,
``synchronize()``, ``Stream.synchronize``, ``Event.synchronize``. Each test states torch's
expected number of findings; the sanitizer's logic is host-side, so it needs no overlap on
the simulator.
"""

from __future__ import annotations

import cudalab
from cudalab import sanitizer


def read(t, s):
    sanitizer.record_launch(reads=[t], stream=s, name="read")


def write(t, s):
    sanitizer.record_launch(writes=[t], stream=s, name="write")


def sync(s_from, s_to):
    e = cudalab.Event()
    e.record(s_from)
    e.wait(s_to)
    return e


def test_empty_kernel_launch(session, streams):
    sanitizer.record_launch(stream=streams[0])
    assert session.reports == []


def test_simple_passing(session, streams, tensors):
    read(tensors[1], streams[1])
    read(tensors[1], streams[2])
    assert session.reports == []


def test_simple_error(session, streams, tensors):
    read(tensors[1], streams[1])
    write(tensors[1], streams[2])
    assert len(session.reports) == 1
    report = session.reports[0]
    assert report.kind == sanitizer.RACE and report.title == "possible data race (write after read)"


def test_simple_sync(session, streams, tensors):
    read(tensors[1], streams[1])
    sync(streams[1], streams[2])
    write(tensors[1], streams[2])
    assert session.reports == []


def test_wait_stream_orders(session, streams, tensors):
    write(tensors[1], streams[1])
    streams[2].wait_stream(streams[1])
    read(tensors[1], streams[2])
    assert session.reports == []


def test_reads_check_last_write(session, streams, tensors):
    write(tensors[1], streams[1])
    sync(streams[1], streams[2])
    read(tensors[1], streams[2])
    assert session.reports == []
    read(tensors[1], streams[3])
    assert len(session.reports) == 1
    assert session.reports[0].title == "possible data race (read after write)"


def test_branch_sync(session, streams, tensors):
    write(tensors[1], streams[1])
    e = cudalab.Event()
    e.record(streams[1])
    e.wait(streams[2])
    e.wait(streams[3])
    read(tensors[1], streams[2])
    read(tensors[1], streams[3])
    assert session.reports == []
    write(tensors[1], streams[2])
    assert len(session.reports) == 1


def test_chain_sync(session, streams, tensors):
    read(tensors[1], streams[0])
    for i in range(10):
        sync(streams[i], streams[i + 1])
    write(tensors[1], streams[10])
    assert session.reports == []


def test_expired_record(session, streams, tensors):
    read(tensors[1], streams[1])
    e = cudalab.Event()
    e.record(streams[1])
    read(tensors[1], streams[1])
    e.wait(streams[2])
    write(tensors[1], streams[2])
    assert len(session.reports) == 1


def test_deleted_record(session, streams, tensors):
    for t, recreate in ((tensors[1], False), (tensors[2], True)):
        read(t, streams[1])
        e = cudalab.Event()
        e.record(streams[1])
        e.close()
        if recreate:
            e = cudalab.Event()
        e.wait(streams[2])
        write(t, streams[2])
    assert len(session.reports) == 2


def test_all_reads_checked_failing(session, streams, tensors):
    for i in range(1, 10):
        read(tensors[1], streams[i])
        sync(streams[i], streams[0])
    read(tensors[1], streams[10])
    write(tensors[1], streams[0])
    assert len(session.reports) == 1
    assert session.reports[0].previous.stream[1] == streams[10].cuda_stream


def test_all_reads_checked_passing(session, streams, tensors):
    for i in range(1, 10):
        read(tensors[1], streams[i])
        sync(streams[i], streams[0])
    write(tensors[1], streams[0])
    assert session.reports == []


def test_multiple_errors(session, streams, tensors):
    for t in tensors:
        write(t, streams[0])
    for t in tensors:
        write(t, streams[1])
    assert len(session.reports) == 10


def test_correct_state_merging(session, streams, tensors):
    write(tensors[1], streams[1])
    write(tensors[2], streams[2])
    e1, e2 = cudalab.Event(), cudalab.Event()
    e1.record(streams[1])
    e2.record(streams[2])
    e1.wait(streams[3])
    e2.wait(streams[3])
    write(tensors[1], streams[3])
    write(tensors[2], streams[3])
    assert session.reports == []


def test_record_override(session, streams, tensors):
    read(tensors[1], streams[1])
    read(tensors[1], streams[2])
    e = cudalab.Event()
    e.record(streams[1])
    e.record(streams[2])
    e.wait(streams[3])
    write(tensors[1], streams[3])
    assert len(session.reports) == 1
    assert session.reports[0].previous.stream[1] == streams[1].cuda_stream


def test_multiple_wait(session, streams, tensors):
    write(tensors[1], streams[1])
    e = cudalab.Event()
    e.record(streams[1])
    e.wait(streams[2])
    e.wait(streams[3])
    read(tensors[1], streams[2])
    read(tensors[1], streams[3])
    assert session.reports == []


def test_device_synchronize(session, streams, tensors):
    for i in range(1, 10):
        write(tensors[i], streams[i])
    cudalab.synchronize()
    for i in range(1, 10):
        write(tensors[i], streams[0])
    assert session.reports == []


def test_device_synchronization_expired(session, streams, tensors):
    write(tensors[1], streams[1])
    cudalab.synchronize()
    write(tensors[1], streams[1])
    write(tensors[1], streams[2])
    assert len(session.reports) == 1


def test_new_stream_is_synchronized(session, streams, tensors):
    write(tensors[1], streams[1])
    cudalab.synchronize()
    fresh = cudalab.Stream()
    write(tensors[1], fresh)
    assert session.reports == []


def test_stream_synchronize(session, streams, tensors):
    write(tensors[1], streams[0])
    write(tensors[2], streams[1])
    streams[0].synchronize()
    read(tensors[1], streams[2])
    read(tensors[1], streams[3])
    assert session.reports == []
    read(tensors[2], streams[4])
    assert len(session.reports) == 1


def test_event_synchronize(session, streams, tensors):
    write(tensors[1], streams[1])
    e = cudalab.Event()
    e.record(streams[1])
    write(tensors[2], streams[1])
    e.synchronize()
    write(tensors[1], streams[2])
    assert session.reports == []
    write(tensors[2], streams[2])
    assert len(session.reports) == 1
