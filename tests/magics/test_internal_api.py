"""The names of :mod:`cudalab._internal` the Jupyter layer uses beyond the runtime's state:
the scratch buffer, event creation, the CUPTI seam, snapshots, NVML and the unit table."""

from __future__ import annotations

import sys

import pytest

import cudalab
import cudalab.memory as cm
from cudalab import _internal
from cudalab.events import Event, record_fast
from cudalab.magics.memory_args import parse_memory_args


def test_scratch_buffer_is_outside_the_caching_allocator():
    cudalab.init()
    before = cm.memory_stats(0)
    buf = _internal.ScratchBuffer(0, 1 << 20)
    assert buf.ptr and buf.nbytes == 1 << 20 and buf.device == 0
    s = cudalab.current_stream(0)
    buf.fill_async(0x1A5, s)  # only the low byte is written
    buf.fill_async(7, s, nbytes=4096)
    s.synchronize()
    assert cm.memory_stats(0) == before  # invisible to the allocator's statistics
    buf.free()
    assert buf.ptr == 0
    buf.free()  # idempotent


def test_create_event_makes_the_driver_event_now():
    cudalab.init()
    ev = Event(enable_timing=True)
    assert _internal.event_handle(ev) is None
    h = _internal.create_event(ev, 0)
    assert h is not None and _internal.event_handle(ev) is h and ev.device_index == 0


def test_record_fast_matches_event_record():
    cudalab.init()
    s = cudalab.current_stream(0)
    a, b = Event(enable_timing=True), Event(enable_timing=True)
    record_fast(a, s)  # no driver event yet: created through Event.record
    cudalab.synchronize()
    record_fast(b, s)
    b.synchronize()
    assert a.query() and b.query() and a.elapsed_time(b) >= 0


def test_cupti_kernel_activity_says_why_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import cupti -> ImportError
    act = _internal.cupti_kernel_activity()
    assert not act.start() and "cupti-python" in act.note
    assert not act.started and not act.active and act.records == []
    act.stop()  # a no-op when not active


def test_snapshot_forward_matches_the_memory_api():
    cudalab.init()
    from cudalab.memory_tools.snapshot import take_snapshot

    snap = take_snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    assert snap["segments"] == cm._snapshot()["segments"]


def test_nvml_and_clock_reasons():
    cudalab.init()
    from cudalab.nvml import nvml_backend

    n = nvml_backend()
    reasons = _internal.clock_event_reasons(0)
    assert reasons is None if n.simulated else isinstance(reasons, int)


@pytest.mark.parametrize("text,expected", [
    ("watch on --threshold 1g", 1 << 30),  # one parser: "1g" is 2**30 (was 10**9 here)
    ("watch on --threshold 64 KiB", 64 << 10),
    ("watch on --threshold 2MiB", 2 << 20),
    ("watch on --threshold 1.5GB", 1_500_000_000),
])
def test_threshold_uses_the_one_size_parser(text, expected):
    assert parse_memory_args(text).threshold == expected == _internal.parse_size(
        text.split("--threshold ", 1)[1].replace(" ", ""))


def test_enable_peer_access_asks_the_driver_once_per_pair(monkeypatch, two_devices):
    import cudalab.devices as devices

    backend = _internal.backend()
    monkeypatch.setattr(devices, "_peer_access", {})
    asked = []
    real = backend.can_access_peer
    monkeypatch.setattr(backend, "can_access_peer",
                        lambda d, p: (asked.append((d, p)), real(d, p))[1])
    assert _internal.enable_peer_access(0, 0) is False  # one device: nothing to enable
    able = _internal.enable_peer_access(1, 0)
    assert able == real(1, 0)
    assert _internal.enable_peer_access(1, 0) == able  # the second time from the cache
    assert asked == [(1, 0)]
