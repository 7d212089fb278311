"""explain_oom (cudalab.oom): one scenario per verdict, the accounting, the referrers and
their release, sites, counterfactuals, the panel and %cuda_memory why.

The scenarios (tests/oom/scenarios.py) size everything from the device's free memory: the
simulator runs them in CI; the ``gpu`` tests run the same scenarios on a GPU (with torch in
the process too when ``CUDALAB_OOM_WITH_TORCH=1``) and check the accounting against NVML.
On a large GPU every test of this module runs on a device scaled down to
``scenarios.SCENARIO_BYTES`` free by one live ballast array (``scenarios.scaled_device``),
so no test fills or frees a whole H200.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

import cudalab
import cudalab.memory as cm
from cudalab import oom
from cudalab.oom import explain_oom
from tests.oom import scenarios

pd = pytest.importorskip("pandas")
GiB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def _scaled():
    if os.environ.get("CUDALAB_OOM_WITH_TORCH") == "1" and not cudalab.devices.backend().simulated:
        torch = pytest.importorskip("torch")
        torch.zeros(1, device="cuda")  # torch's context first: the ballast leaves the rest
    with scenarios.scaled_device() as ballast:
        yield ballast


@pytest.fixture(autouse=True)
def _clean():
    oom.watch()  # the observers read the device at each error (as %load_ext does)
    oom.session.forget()
    gc.collect()
    cm.empty_cache()
    yield
    oom.session.forget()
    gc.collect()
    cm.empty_cache()
    for d in range(cudalab.device_count()):  # the scenarios' OOM counts: for later tests
        cm.reset_accumulated_memory_stats(d)


def _check_accounting(expl) -> None:
    acc = expl.accounting
    assert list(acc.columns) == ["category", "source", "bytes", "detail"]
    assert int(acc["bytes"].sum()) == acc.attrs["total"] == expl.state.total
    assert (acc["bytes"].iloc[:-1] >= 0).all()
    assert abs(acc.attrs["residual"]) <= max(64 << 20, acc.attrs["total"] // 100), acc


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_scenario_verdict(name):
    if not cudalab.devices.backend().simulated:
        pytest.skip("on a GPU, test_scenario_verdict_gpu runs the scenario")
    _check_scenario(name)


def _check_scenario(name):
    expected, expl = scenarios.run(name)
    assert expl.verdict == expected, (expl.verdict, expl.reasons)
    assert expl.request is not None and expl.shortfall is not None
    _check_accounting(expl)
    text = expl.summary()
    assert expected.replace("_", " ") in text and "fix:" in text
    html = expl._repr_html_()
    assert "cudalab-oom" in html and expected in html
    if not cudalab.devices.backend().simulated:
        return
    assert "SIMULATED" in html


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_scenario_verdict_gpu(name):
    if os.environ.get("CUDALAB_OOM_WITH_TORCH") == "1":
        torch = pytest.importorskip("torch")
        torch.zeros(1, device="cuda")  # torch's allocator and context in the process
    _check_scenario(name)


def test_held_by_python_release_frees_the_memory():
    free, total = cm.mem_get_info()
    try:
        scenarios._hold_in_traceback(int(free * 0.6))
    except RuntimeError as err:
        sys.last_type, sys.last_value, sys.last_traceback = type(err), err, err.__traceback__
    try:
        exc = scenarios._fail(free * 0.6)
        expl = explain_oom(error=exc)
        del exc
        assert expl.verdict == "held_by_python"
        rows = [r for r in expl.referrers if r.kind == "traceback"]
        assert rows and rows[0].disposable and rows[0].held_by_python
        assert "_hold_in_traceback() local 'big'" in rows[0].holder
        before = cm.memory_allocated()
        done = expl.release()
        assert done["released"] and done["freed"] >= int(free * 0.6) - (2 << 20)
        assert cm.memory_allocated() <= before - int(free * 0.6) + (2 << 20)
    finally:
        scenarios._clear_last()


def test_referrers_name_user_names_and_containers():
    ns = sys.modules["__main__"].__dict__
    ns["_oom_test_x"] = cudalab.empty(64 << 20, dtype="uint8")
    ns["_oom_test_list"] = [cudalab.empty(32 << 20, dtype="uint8")]
    view_base = cudalab.empty(16 << 20, dtype="uint8")
    ns["_oom_test_view"] = view_base[: 1 << 20]
    del view_base
    try:
        refs = oom.find_referrers(0)
        by_holder = {r.holder: r for r in refs}
        assert by_holder["_oom_test_x"].kind == "name"
        assert not by_holder["_oom_test_x"].disposable
        assert by_holder["_oom_test_x"].nbytes == 64 << 20
        assert by_holder["_oom_test_list[0]"].kind == "container"
        assert by_holder["_oom_test_view"].nbytes == 16 << 20  # the view keeps its base
        frame = refs.to_frame()
        assert set(frame.columns) >= {"array", "holder", "kind", "disposable"}
        done = refs.release(["_oom_test_x"])
        assert done["released"] == ["_oom_test_x"] and "_oom_test_x" not in ns
        assert done["freed"] >= 64 << 20
    finally:
        for k in ("_oom_test_x", "_oom_test_list", "_oom_test_view"):
            ns.pop(k, None)


def test_no_error_explains_the_current_state_and_says_what_it_cannot_tell():
    keep = cudalab.empty(256 << 20, dtype="uint8")
    expl = explain_oom()
    assert expl.request is None and expl.shortfall is None
    assert expl.verdict in oom.VERDICTS
    assert "no out-of-memory error" in expl.summary()
    assert any("history is off" in u for u in expl.unknown)
    assert expl.sites is None and expl.counterfactuals is None
    _check_accounting(expl)
    del keep


def test_sites_and_counterfactuals_from_the_history():
    free, total = cm.mem_get_info()
    with cm.record_history():
        keep = [cudalab.empty(int(free * 0.2), dtype="uint8") for _ in range(3)]
        exc = scenarios._fail(free * 0.5)
        expl = explain_oom(error=exc, replays=True)
    del exc
    try:
        assert expl.sites is not None and len(expl.sites)
        # (on a large GPU the module's ballast, allocated before the history, is larger)
        mine = expl.sites[expl.sites["site"].str.contains("test_explain_oom.py", regex=False)]
        assert len(mine) and mine["bytes"].iloc[0] >= 3 * int(free * 0.2), expl.sites
        cf = expl.counterfactuals
        assert cf is not None and {"setting", "peak_reserved", "fits"} <= set(cf.columns)
        default = cf[cf["setting"] == "default"].iloc[0]
        assert not default["fits"]  # the replay reproduces the failure
    finally:
        del keep


def test_bad_arguments():
    with pytest.raises(ValueError, match="source"):
        explain_oom(source="tensorflow")
    with pytest.raises(ValueError, match="not an out-of-memory error"):
        explain_oom(error=KeyError("x"))


def test_oom_text_parsing_and_error_detection():
    text = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 3 has a total capacity of "
            "139.80 GiB of which 1.00 GiB is free.")
    assert oom.session.parse_oom_text(text) == (3, 20 << 20)
    assert oom.session.parse_oom_text("Out of memory allocating 1,024 bytes (allocated so "
                                      "far: 0 bytes).") == (None, 1024)
    inner = cudalab.OutOfMemoryError(text=text)
    outer = RuntimeError("wrapped")
    outer.__cause__ = inner
    assert oom.is_oom_error(outer) is inner
    assert oom.is_oom_error(KeyError()) is None


def test_why_magic_on_a_failed_cell():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing import globalipapp
    from IPython.utils.capture import capture_output

    # (the shell another test file of this process made, whichever kind it is: IPython
    # allows one InteractiveShell singleton per process)
    shell = InteractiveShell.instance() if InteractiveShell.initialized() \
        else globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "cudalab")
    try:
        free, total = cm.mem_get_info()
        before = cm.memory_allocated()  # (a large GPU's ballast)
        shell.run_cell(f"import cudalab\n_oom_keep = cudalab.empty({int(free * 0.6)}, "
                       "dtype='uint8')\n_oom_keep", store_history=True)
        shell.run_cell("del _oom_keep", store_history=True)
        with capture_output():
            r = shell.run_cell(f"cudalab.empty({int(free * 0.6)}, dtype='uint8')",
                               store_history=True)
        assert not r.success
        err, event = oom.last_oom()
        assert err is r.error_in_exec and event is not None and event.state is not None
        with capture_output() as cap:
            shell.run_line_magic("cuda_memory", "why")
        html = "".join(o.data.get("text/html", "") for o in cap.outputs)
        assert "held_by_python" in html and "Out[" in html
        with capture_output() as cap:
            shell.run_line_magic("cuda_memory", "why release")
        assert "came back" in cap.stdout
        assert cm.memory_allocated() < before + int(free * 0.6)
    finally:
        shell.run_line_magic("unload_ext", "cudalab")
        shell.run_cell("_ = __ = ___ = None", store_history=False)


@pytest.mark.gpu
def test_torch_out_of_memory_is_explained():
    torch = pytest.importorskip("torch")
    torch.zeros(1, device="cuda")
    oom.watch()  # torch's observer too, now that torch is imported
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    warm = [torch.empty(1 << 20, device="cuda") for _ in range(8)]  # some torch history
    held = warm[:2]  # two of them live at the error: the sites name this file for them
    del warm
    free, total = cm.mem_get_info()
    keep = cudalab.empty(int(free * 0.7), dtype="uint8")
    try:
        try:
            torch.empty(int(free * 0.5), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            assert oom.note_error(exc)
        err, event = oom.last_oom()
        assert isinstance(err, torch.OutOfMemoryError)
        assert event is not None and event.source == "torch" and event.state is not None
        expl = explain_oom(replays=True)
        assert expl.source == "torch" and expl.verdict == "live_arrays", expl.reasons
        assert {"cudalab", "torch"} <= set(expl.accounting["source"])
        _check_accounting(expl)
        assert expl.counterfactuals is not None, expl.unknown  # from torch's history
        assert expl.sites is not None, expl.unknown
        mine = expl.sites[expl.sites["site"].str.startswith("torch: ")
                          & expl.sites["site"].str.contains("test_explain_oom.py", regex=False)]
        assert len(mine) and int(mine["bytes"].sum()) >= 2 * (4 << 20), expl.sites
    finally:
        torch.cuda.memory._record_memory_history(None)
        del keep, held
        torch.cuda.empty_cache()


def test_an_uncaught_error_of_a_console_is_found_in_sys_last_value():
    free, total = cm.mem_get_info()
    keep = cudalab.empty(int(free * 0.6), dtype="uint8")
    exc = scenarios._fail(free * 0.6)
    oom.session.forget()  # as if no extension had seen it
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    try:
        expl = explain_oom()
        assert expl.request is not None and expl.error is exc
        assert expl.verdict == "live_arrays"
    finally:
        del keep, exc
        scenarios._clear_last()


def test_a_large_device_is_scaled_down_by_a_live_ballast(monkeypatch):
    if not cudalab.devices.backend().simulated:
        pytest.skip("on a GPU, the module's own ballast is under every scenario already")
    free, total = cm.mem_get_info()
    outer = len(scenarios.BALLAST)  # (the module's own ballast, on a large GPU)
    monkeypatch.setattr(scenarios, "SCENARIO_BYTES", free // 4)  # as a device 4x too large
    with scenarios.scaled_device() as ballast:
        assert ballast > 0 and len(scenarios.BALLAST) == outer + 1
        left, _ = cm.mem_get_info()
        assert abs(left - free // 4) <= (4 << 20)
        for name in sorted(scenarios.SCENARIOS):  # every verdict beside a ballast
            expected, expl = scenarios.run(name)
            assert expl.verdict == expected, (name, expl.reasons)
            _check_accounting(expl)
            del expl
            oom.session.forget()
    assert len(scenarios.BALLAST) == outer and cm.mem_get_info()[0] >= free - (4 << 20)
    monkeypatch.setattr(scenarios, "SCENARIO_BYTES", free)  # small enough: no ballast
    with scenarios.scaled_device() as ballast:
        assert ballast == 0 and len(scenarios.BALLAST) == outer


def test_counterfactuals_leave_out_memory_held_from_before_the_history():
    free, total = cm.mem_get_info()
    early = cudalab.empty(int(free * 0.4), dtype="uint8")  # live, not in the history
    try:
        with cm.record_history():
            keep = [cudalab.empty(int(free * 0.2), dtype="uint8") for _ in range(2)]
            exc = scenarios._fail(free * 0.3)
            expl = explain_oom(error=exc, replays=True)
        del exc
        cf = expl.counterfactuals
        assert cf is not None and cf.attrs["before_history"] >= int(free * 0.4)
        # the replays' device lacks what the early block holds: the failure is reproduced
        assert not cf[cf["setting"] == "default"]["fits"].iloc[0], cf
        assert cf.attrs["capacity"] <= total - int(free * 0.4)
        del keep
    finally:
        del early
