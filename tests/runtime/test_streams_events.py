"""Streams and events: identity, current-stream rules, timing, IPC, ownership (both backends)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

import cudalab
from cudalab import streams as streams_mod


def test_default_and_current_stream():
    d = cudalab.default_stream()
    assert d.cuda_stream == 0 and d.device_index == 0
    assert cudalab.current_stream() is d
    assert cudalab.default_stream(0) is d
    assert d.query() is True
    d.synchronize()
    assert d.__cuda_stream__() == (0, 0)
    assert d.device == cudalab.Device("cuda:0")


def test_stream_identity_and_priority(backend):
    least, greatest = cudalab.Stream.priority_range()
    assert greatest <= least
    s = cudalab.Stream(priority=-100)  # clamped to the greatest priority
    t = cudalab.Stream(priority=100)   # clamped to the least
    assert s.priority == greatest and t.priority == least
    assert s != t and s == s and hash(s) == hash((0, s.cuda_stream))
    assert s.cuda_stream != 0
    assert "cudalab.Stream device=cuda:0" in repr(s)
    assert s.__cuda_stream__() == (0, s.cuda_stream)
    with pytest.raises(TypeError):
        cudalab.Stream(priority=1.5)
    with pytest.raises(TypeError):
        cudalab.Stream(bogus=1)


def test_stream_context_restores(two_devices):
    s0 = cudalab.Stream(0)
    s1 = cudalab.Stream(1)
    base0 = cudalab.current_stream(0)
    with cudalab.stream(s1):
        assert cudalab.current_device() == 1
        assert cudalab.current_stream() == s1
        with cudalab.stream(s0):
            assert cudalab.current_device() == 0
            assert cudalab.current_stream() == s0
        assert cudalab.current_stream() == s1
    assert cudalab.current_device() == 0
    assert cudalab.current_stream(0) == base0
    assert cudalab.current_stream(1) == cudalab.default_stream(1)
    with cudalab.stream(None):
        assert cudalab.current_stream() == base0
    with s0 as entered:
        assert entered is s0 and cudalab.current_stream() is s0
    assert cudalab.current_stream() == base0
    with pytest.raises(TypeError):
        cudalab.stream("not a stream")


def test_set_stream_switches_device(two_devices):
    s1 = cudalab.Stream(1)
    cudalab.set_stream(s1)
    assert cudalab.current_device() == 1 and cudalab.current_stream() is s1
    cudalab.set_stream(None)  # ignored
    assert cudalab.current_stream() is s1
    with pytest.raises(TypeError):
        cudalab.set_stream(42)


def test_current_stream_is_per_thread():
    s = cudalab.Stream()
    cudalab.set_stream(s)
    seen = []
    t = threading.Thread(target=lambda: seen.append(cudalab.current_stream()))
    t.start()
    t.join()
    assert seen == [cudalab.default_stream()]
    assert cudalab.current_stream() is s


def test_custom_stream_tokens_follow_every_thread(two_devices):
    """streams.custom_stream_tokens holds one token per (thread, device) whose current stream is not the
    default stream: the allocator trusts an empty list to mean stream=None is handle 0."""
    custom = streams_mod.custom_stream_tokens
    assert custom == []
    s0, s1 = cudalab.Stream(0), cudalab.Stream(1)
    with cudalab.stream(s0):
        assert len(custom) == 1
        with cudalab.stream(s1):
            assert len(custom) == 2
            with cudalab.stream(cudalab.default_stream(1)):
                assert len(custom) == 1  # handle 0 is the default stream
            with cudalab.stream(s0):  # back to device 0 inside: slot 0 stays custom
                assert len(custom) == 2
            assert len(custom) == 2
        assert len(custom) == 1
    assert custom == []
    cudalab.set_stream(s0)
    cudalab.set_stream(s0)  # no second token for the same slot
    assert len(custom) == 1
    cudalab.set_stream(cudalab.default_stream(0))
    assert custom == []
    ext = cudalab.ExternalStream(0)  # a wrapped handle 0 is the default stream too
    cudalab.set_stream(ext)
    assert custom == []

    started, done = threading.Event(), threading.Event()

    def other():
        cudalab.set_stream(cudalab.Stream(0))
        started.set()
        done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert started.wait(10)
    assert len(custom) == 1  # another thread's current stream counts
    done.set()
    t.join()
    assert len(custom) == 1  # it ended with its stream current: the token stays (conservative)
    custom.clear()


def test_events_record_query_sync():
    e = cudalab.Event()
    assert e.query() is True  # never recorded
    assert e.cuda_event == 0 and "uninitialized" in repr(e)
    e.synchronize()
    s = cudalab.Stream()
    assert e.record(s) is e
    e.synchronize()
    assert e.query() is True and e.device_index == 0
    e.record()  # on the (default) current stream
    e.wait()
    e.wait(s)
    s.wait_event(e)
    s.wait_stream(cudalab.default_stream())
    ev = s.record_event()
    ev.synchronize()
    assert ev.query()


def test_event_timing_and_errors():
    a = cudalab.Event(enable_timing=True)
    b = cudalab.Event(enable_timing=True)
    with pytest.raises(ValueError, match="Both events must be recorded"):  # torch's type and text
        a.elapsed_time(b)
    untimed = cudalab.Event()
    untimed.record()
    with pytest.raises(ValueError, match="created with argument 'enable_timing=True'"):
        untimed.elapsed_time(untimed)
    a.record()
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b)
    assert isinstance(ms, float) and ms >= 0.0
    c = cudalab.Event()
    c.record()
    with pytest.raises(ValueError, match="enable_timing"):
        a.elapsed_time(c)


def test_event_flags_validation():
    with pytest.raises(ValueError):
        cudalab.Event(enable_timing=True, interprocess=True)
    e = cudalab.Event(blocking=True)
    e.record()
    e.synchronize()
    with pytest.raises(RuntimeError, match="interprocess"):
        cudalab.Event().ipc_handle()


def test_event_device_mismatch(two_devices):
    e = cudalab.Event()
    e.record(cudalab.Stream(0))
    with pytest.raises(ValueError, match="cuda:0"):
        e.record(cudalab.Stream(1))


def test_event_on_other_device_stream(two_devices):
    """Recording on a device that is not current works (device guard like torch)."""
    s1 = cudalab.Stream(1)
    e = cudalab.Event(enable_timing=True)
    e.record(s1)
    e.synchronize()
    assert e.device_index == 1 and cudalab.current_device() == 0
    f = cudalab.Event(enable_timing=True)
    f.record(cudalab.default_stream(1))  # null stream of a non-current device
    f.synchronize()
    assert e.elapsed_time(f) >= 0


def test_ipc_handle_shape_and_errors():
    e = cudalab.Event(interprocess=True)
    h = e.ipc_handle()
    assert isinstance(h, bytes) and len(h) == 64
    with pytest.raises(ValueError):
        cudalab.Event.from_ipc_handle(0, b"short")
    with pytest.raises(TypeError):
        cudalab.Event.from_ipc_handle(0, "text")


def test_ipc_event_round_trip_in_child_process():
    """The child opens the parent's event by handle and waits on it."""
    e = cudalab.Event(interprocess=True)
    e.record()
    h = e.ipc_handle()
    code = textwrap.dedent(f"""
        import cudalab
        ev = cudalab.Event.from_ipc_handle(0, bytes.fromhex({h.hex()!r}))
        ev.synchronize()
        cudalab.current_stream().wait_event(ev)
        print('opened', ev.query())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "opened True"


def test_close_is_deterministic_and_idempotent(backend):
    s = cudalab.Stream()
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        _ = s.priority
    assert "closed" in repr(s)
    e = cudalab.Event()
    e.record()
    e.close()
    e.close()
    assert e.query() is True
    cudalab.default_stream().close()  # not owned: a no-op
    assert cudalab.default_stream().query()


def test_handles_released_by_gc_without_errors():
    for _ in range(200):
        s = cudalab.Stream()
        e = cudalab.Event()
        e.record(s)
    del s, e
    gc.collect()


def test_external_stream_wraps_without_owning(backend):
    s = cudalab.Stream()
    ext = cudalab.ExternalStream(s.cuda_stream)
    assert ext == s and ext.cuda_stream == s.cuda_stream
    e = cudalab.Event()
    e.record(ext)
    ext.synchronize()
    ext.close()  # not owned: s stays valid
    assert s.query()
    with pytest.raises(TypeError):
        cudalab.ExternalStream(-1)


def test_sync_debug_mode():
    assert cudalab.get_sync_debug_mode() == 0
    try:
        cudalab.set_sync_debug_mode("warn")
        assert cudalab.get_sync_debug_mode() == 1
        with pytest.warns(UserWarning, match="synchronizing"):
            cudalab.Stream().synchronize()
        cudalab.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchronizing"):
            cudalab.synchronize()
        with pytest.raises(RuntimeError, match="synchronizing"):
            cudalab.Event().synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cudalab.Event().record()  # not synchronizing: no warning/error
        with pytest.raises(RuntimeError, match="debug_mode"):
            cudalab.set_sync_debug_mode("loud")
        with pytest.raises(RuntimeError):
            cudalab.set_sync_debug_mode(3)
        assert cudalab.get_sync_debug_mode() == 2  # unchanged by the bad calls
    finally:
        cudalab.set_sync_debug_mode(0)


def test_streams_module_exit_flag_exists():
    assert streams_mod.exiting is False


def test_event_context_manager_releases_handle():
    with cudalab.Event(enable_timing=True) as e:
        e.record()
        e.synchronize()
        assert e.cuda_event != 0
    assert e.cuda_event == 0 and e.query() is True
