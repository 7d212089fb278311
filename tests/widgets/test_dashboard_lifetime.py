"""A dashboard's sampler thread ends when its owner does, and its interval can neither make
it spin nor kill it. Runs without a kernel (ipywidgets' DummyComm), as test_widgets.py."""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest

W = pytest.importorskip("ipywidgets")

import ipywidgets.widgets.widget as widget_module  # noqa: E402

from cudalab.widgets import MemoryDashboard, live_dashboards  # noqa: E402
from cudalab.widgets import dashboard as dashboard_module  # noqa: E402


def samplers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == dashboard_module._THREAD_NAME]


def wait_until(condition, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(autouse=True)
def _no_dashboards_left():
    yield
    for d in live_dashboards():
        d.close()


def test_dropped_dashboards_stop_sampling():
    before = len(samplers())
    dashboards = [MemoryDashboard(interval=0.05) for _ in range(20)]
    assert len(samplers()) == before + 20
    del dashboards
    gc.collect()
    assert wait_until(lambda: len(samplers()) == before, timeout=3.0), len(samplers())


def test_a_displayed_dashboard_lives_until_closed():
    """``display(MemoryDashboard())`` keeps no variable: the dashboard is on screen, so it
    keeps sampling until it is closed, as any widget shown."""
    before = len(samplers())
    d = MemoryDashboard(interval=0.05)
    d._repr_mimebundle_()  # what display() and a cell's result call
    del d
    gc.collect()
    time.sleep(0.2)
    assert len(samplers()) == before + 1
    (shown,) = [x for x in live_dashboards() if x in dashboard_module._shown]
    shown.close()
    assert shown not in dashboard_module._shown
    assert wait_until(lambda: len(samplers()) == before, timeout=3.0)


def test_a_dropped_dashboard_is_closed_with_its_widgets():
    """Collected, it is closed: its widgets leave ipywidgets' registry (no leak per cell
    re-run), and it is no longer among the live dashboards."""
    gc.collect()
    registered = len(widget_module._instances)
    d = MemoryDashboard(interval=0.05)
    assert len(widget_module._instances) > registered
    comm = d.comm
    del d
    gc.collect()
    assert wait_until(lambda: len(widget_module._instances) == registered)
    assert comm._closed and live_dashboards() == []


def test_a_referenced_dashboard_keeps_sampling_and_its_controls_work():
    d = MemoryDashboard(devices=0, interval=0.02)
    gc.collect()
    n = d._n
    assert wait_until(lambda: d._n >= n + 3) and d.running
    d._pause.value = True  # through the weak callbacks
    assert d._paused and d._pause.description == "Resume"
    d._pause.value = False
    d._reset.click()
    assert "peaks reset" in d._status.value
    sent = []
    d.comm.send = lambda *args, **kwargs: sent.append(kwargs or args)
    d.comm.handle_msg({"content": {"data": {"method": "request_state"}}})  # the frontend asks
    assert sent  # the message reached the dashboard through its weak comm callback
    d.close()
    assert not d.running and d.comm is None


def test_a_dashboard_kept_by_the_magic_lives_on():
    """Kept in a list (as %cuda_memory dashboard keeps its own), it lives."""
    keep = [MemoryDashboard(devices=0, interval=0.02)]
    gc.collect()
    n = keep[0]._n
    assert wait_until(lambda: keep[0]._n >= n + 3)
    keep[0].close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e300, 86_401, 0, -1])
def test_an_absurd_interval_is_refused(bad):
    before = len(samplers())
    with pytest.raises(ValueError, match=r"interval must be in \(0, 86400\] seconds"):
        MemoryDashboard(interval=bad)
    assert len(samplers()) == before  # no thread started
    d = MemoryDashboard(interval=0.5, start=False)
    with pytest.raises(ValueError, match=r"interval must be in \(0, 86400\] seconds"):
        d.interval = bad
    assert d.interval == 0.5
    d.close()


@pytest.mark.parametrize("bad", [None, "fast", [1]])
def test_an_interval_that_is_no_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="interval must be a number of seconds"):
        MemoryDashboard(interval=bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0, -3, 1e9])
def test_an_absurd_max_rate_is_refused(bad):
    with pytest.raises(ValueError, match=r"max_rate must be in \(0, 1000\]"):
        MemoryDashboard(max_rate=bad)


def test_short_intervals_still_count_as_the_minimum():
    d = MemoryDashboard(interval=0.001, start=False)
    assert d.interval == dashboard_module.MIN_INTERVAL
    d.interval = 3
    assert d.interval == 3.0
    d.close()


def test_the_sampler_never_spins_nor_dies_whatever_it_reads():
    """Even with the validation bypassed, a NaN interval samples at the minimum interval
    (it made ~56,000 samples in 2 s) and an infinite one waits instead of dying."""
    d = MemoryDashboard(devices=0, interval=0.05)
    d._interval = math.nan
    n = d._n
    time.sleep(0.4)
    assert d._n - n <= 0.4 / dashboard_module.MIN_INTERVAL + 5
    d._interval = math.inf
    time.sleep(0.3)  # (it still has the tick it was waiting for to do first)
    assert d.running
    n = d._n
    time.sleep(0.3)
    assert d._n <= n + 1 and d.running  # waiting, not dead
    d.close()
    assert not d.running
