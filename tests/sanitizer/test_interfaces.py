"""The sanitizer's interfaces: enable/disable, the context manager, the raise/warn/collect
modes, the report's text, ``record_launch``'s arguments, ``CUDALAB_SANITIZER``, and the
off-cost (a site reads one flag and calls nothing while the sanitizer is off)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import cudalab
from cudalab import _observe, _sanitizer_hook, sanitizer
from cudalab.testing import count_calls

ROOT = Path(__file__).resolve().parents[2]


def race():
    """A write-after-write on two fresh streams (the report's first access is line +5)."""
    a = cudalab.empty(64)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with cudalab.stream(s1):
        a.fill_(1)
    with cudalab.stream(s2):
        a.fill_(2)
    cudalab.synchronize()  # (so that dropping a is safe)
    return a


def test_enable_disable_and_is_enabled():
    cudalab.init()
    assert not sanitizer.is_enabled()
    session = sanitizer.enable("collect")
    try:
        assert sanitizer.is_enabled() and _sanitizer_hook.on
        race()
        assert len(sanitizer.reports()) == 1 and len(session.reports) == 1
        assert session.accesses >= 2
    finally:
        sanitizer.disable()
    assert not sanitizer.is_enabled() and _sanitizer_hook.tracker is None
    assert sanitizer.reports() == []
    sanitizer.disable()  # idempotent


def test_the_context_manager_restores_the_previous_state():
    cudalab.init()
    outer = sanitizer.enable("collect")
    try:
        with sanitizer.sanitize("collect") as inner:
            race()
        assert len(inner.reports) == 1 and outer.reports == []
        assert sanitizer.is_enabled()
    finally:
        sanitizer.disable()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="on_race must be one of"):
        sanitizer.enable("explode")
    assert not sanitizer.is_enabled()


def test_raise_mode_raises_from_the_racing_operation():
    cudalab.init()
    with pytest.raises(sanitizer.StreamRaceError) as info:  # noqa: PT012
        with sanitizer.sanitize():
            a = cudalab.empty(64)
            s1, s2 = cudalab.Stream(), cudalab.Stream()
            with cudalab.stream(s1):
                a.fill_(1)
            with cudalab.stream(s2):
                a.fill_(2)
            pytest.fail("the second fill did not raise")
    assert len(info.value.reports) == 1
    assert str(info.value).startswith("detected 1 error\n")
    assert not sanitizer.is_enabled()


def _racing_fill(a, b):
    a.fill_(2)


def _racing_copy(a, b):
    a.copy_(b)


def _racing_complex_fill(a, b):
    a.view(np.complex128).fill_(2 + 1j)  # (memset, kernels and copies: the longest path)


@pytest.mark.parametrize("operation", [_racing_fill, _racing_copy, _racing_complex_fill])
def test_raise_mode_runs_the_racing_operation_then_raises(operation):
    """torch's CSAN runs the racing operation, then raises; kernels already did (issue 36,
    item 22)."""
    cudalab.init()
    a = cudalab.zeros(64, dtype=np.float64)
    b = cudalab.full((64,), 2.0, dtype=np.float64)
    cudalab.synchronize()
    expected = b.numpy() if operation is not _racing_complex_fill else \
        np.full(32, 2 + 1j).view(np.float64)
    with pytest.raises(sanitizer.StreamRaceError):  # noqa: PT012
        with sanitizer.sanitize():
            s1, s2 = cudalab.Stream(), cudalab.Stream()
            with cudalab.stream(s1):
                a.fill_(1)
            with cudalab.stream(s2):
                operation(a, b)
    cudalab.synchronize()
    np.testing.assert_array_equal(a.numpy(), expected)


def test_raise_mode_raises_a_free_finding_at_the_end_of_the_block():
    cudalab.init()
    with pytest.raises(sanitizer.StreamRaceError) as info:  # noqa: PT012
        with sanitizer.sanitize():
            a, b = cudalab.zeros(64), cudalab.empty(64)
            user = cudalab.Stream()
            user.wait_stream(cudalab.current_stream())
            with cudalab.stream(user):
                b.copy_(a)
            del a  # a finalizer cannot raise: the finding waits
            gc.collect()
    assert [r.kind for r in info.value.reports] == [sanitizer.UNSAFE_REUSE]


def test_warn_mode_warns_and_goes_on():
    cudalab.init()
    with sanitizer.sanitize("warn") as session:
        with pytest.warns(sanitizer.StreamRaceWarning, match="write after write"):
            race()
    assert len(session.reports) == 1


def test_collect_mode_neither_raises_nor_warns():
    cudalab.init()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sanitizer.sanitize("collect") as session:
            race()
    assert len(session.reports) == 1


def test_the_report_text():
    cudalab.init()
    with sanitizer.sanitize("collect") as session:
        race()
    text = str(session.reports[0])
    here = __file__
    lines = text.splitlines()
    assert lines[0] == "============================"
    assert lines[1].startswith("cudalab sanitizer detected a possible data race (write after "
                               "write) on allocation 0x")
    simulated = " (simulated)" if cudalab.get_device_properties(0).simulated else ""
    assert lines[1].endswith(f"(256 B) of cuda:0{simulated}")
    assert lines[2].startswith("Access by stream 0x") and lines[2].endswith(" during fill")
    assert lines[3].startswith("writing to bytes [0x")
    assert lines[4] == "With stack trace:"
    current = lines[5:lines.index(next(x for x in lines if x.startswith("Previous access")))]
    current = [x for x in current if x]
    assert f'File "{here}", line' in current[-2] and "in race" in current[-2]  # innermost last
    assert current[-1].strip() == "a.fill_(2)"
    assert "Previous access by stream 0x" in text and "a.fill_(1)" in text
    assert "Allocation was made with stack trace:" in text and "a = cudalab.empty(64)" in text
    assert "Fix: order the second access after the first: queue second.wait_stream(first)" in text
    assert lines[-1] == sanitizer.NOT_SEEN and "CuPy, torch" in sanitizer.NOT_SEEN
    assert "cudalab/" not in text.replace(here, "")  # only the user's frames


def test_the_html_table():
    cudalab.init()
    with sanitizer.sanitize("collect") as session:
        race()
    html = session._repr_html_()
    assert "<table>" in html and "possible data race (write after write)" in html
    assert "1 finding</b> (" in html and "accesses checked" in html
    with sanitizer.sanitize("collect") as clean:
        cudalab.zeros(8).numpy()
    assert "no unsynchronized access found</b> (2 accesses checked)" in clean._repr_html_()


def test_record_launch_arguments():
    cudalab.init()
    a = cudalab.empty(16)
    # (both streams stay alive: a destroyed stream's handle may be reused by the next one,
    # which the sanitizer then takes for the same stream, as the docs say)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with sanitizer.sanitize("collect") as session:
        sanitizer.record_launch(writes=a, stream=s1)
        sanitizer.record_launch(writes=[(a.data_ptr(), 4)], stream=s2)
        sanitizer.record_launch(reads=[a.data_ptr() + 8])  # an int: to the allocation's end
        with pytest.raises(TypeError, match="reads must hold arrays"):
            sanitizer.record_launch(reads=["a"])
        with pytest.raises(ValueError, match=r"\(ptr, nbytes\)"):
            sanitizer.record_launch(writes=[(1, 2, 3)])
        with pytest.raises(TypeError, match="stream must be a cudalab.Stream"):
            sanitizer.record_launch(writes=a, stream=0)
    assert len(session.reports) == 2  # the second write, then the read past byte 8
    sanitizer.record_launch(writes=a)  # off: a no-op


# ----------------------------------------------------------------- CUDALAB_SANITIZER
def _script(env_value: str | None, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDALAB_SIMULATOR="1", PYTHONPATH=str(ROOT))
    env.pop("CUDALAB_SANITIZER", None)
    if env_value is not None:
        env["CUDALAB_SANITIZER"] = env_value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


RACY = ("import cudalab, sys\n"
        "print('loaded' if 'cudalab.sanitizer' in sys.modules else 'not loaded')\n"
        "a = cudalab.empty(64)\n"
        "s1, s2 = cudalab.Stream(), cudalab.Stream()\n"
        "with cudalab.stream(s1): a.fill_(1)\n"
        "with cudalab.stream(s2): a.fill_(2)\n"
        "print('finished')\n")


def test_env_var_raises_in_a_script():
    r = _script("1", RACY)
    assert r.returncode == 1, r.stderr
    assert r.stdout.splitlines() == ["loaded"]
    assert "StreamRaceError: detected 1 error" in r.stderr
    assert 'File "<string>", line 6' in r.stderr


def test_env_var_warn_mode():
    r = _script("warn", RACY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["loaded", "finished"]
    assert "StreamRaceWarning" in r.stderr


def test_env_var_prints_a_free_finding_left_at_exit():
    r = _script("1", "import cudalab\n"
                     "a, b = cudalab.zeros(64), cudalab.empty(64)\n"
                     "user = cudalab.Stream()\n"
                     "user.wait_stream(cudalab.current_stream())\n"
                     "with cudalab.stream(user): b.copy_(a)\n"
                     "del a\n")
    assert "cudalab sanitizer: 1 finding(s) at frees after the last access" in r.stderr
    assert "unsafe reuse" in r.stderr


@pytest.mark.parametrize("value", [None, "", "0"])
def test_without_the_env_var_the_sanitizer_is_not_imported(value):
    r = _script(value, RACY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["not loaded", "finished"]


# ----------------------------------------------------------------- off means free
class _Spy:
    """Counts every call the access sites make to the tracker."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls += 1
        return call


def _workload():
    a = cudalab.empty(256)
    side = cudalab.Stream()
    e = cudalab.Event()
    with cudalab.stream(side):
        a.fill_(1)
        cudalab.uniform_(a)
        e.record()
    e.wait()
    side.wait_stream(cudalab.current_stream())
    b = cudalab.empty(256)
    b.copy_(a)
    b.copy_(np.ones(256, np.float32))
    a.record_stream(side)
    e.synchronize()
    side.synchronize()
    cudalab.synchronize()
    b.numpy()
    del a, b


def test_off_the_sites_call_nothing(monkeypatch):
    cudalab.init()
    spy = _Spy()
    _workload()
    assert spy.calls == 0 and not _sanitizer_hook.on  # nobody subscribed: no site calls
    _observe.subscribe_access(spy)
    try:
        assert _sanitizer_hook.on and _sanitizer_hook.tracker is spy
        _workload()
    finally:
        _observe.unsubscribe_access(spy)
    assert spy.calls >= 15  # every site reports once the flag is on
    assert not _sanitizer_hook.on and _sanitizer_hook.tracker is None


def test_the_sanitizer_makes_no_driver_call():
    cudalab.init()
    _workload()  # warm: kernels loaded, events created
    with count_calls() as off:
        _workload()
    with sanitizer.sanitize("collect"), count_calls() as on:
        _workload()
    assert on == off
