"""The IPython extension (issue 6): %load_ext cudalab, %%cuda_timed, %cuda_memory.

In-process shell tests (IPython's own test shell, a TerminalInteractiveShell with a
throw-away history) on the simulator; ``@pytest.mark.gpu`` tests compare with torch events
and cupyx.profiler.benchmark, check --cold on an L2-resident kernel and --kernels on a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.lib.pretty import pretty
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

import cudalab
import cudalab.memory as cm
from cudalab._internal import format_bytes, format_time, parse_size
from cudalab.magics import CudaLabMagics, load_ipython_extension, unload_ipython_extension
from cudalab.magics.result import CudaTimedResult
from cudalab.magics.timed import _nice_ceil, parse_devices, parse_options

MS = 1_000_000  # ns


def _sim() -> bool:
    """Whether the tests run on the simulator (then every report must say so)."""
    return cudalab.devices.backend().simulated


def _SIM_TAG() -> str:  # noqa: N802
    return ", simulated" if _sim() else ""


# =============================================================================== fixtures
@pytest.fixture(scope="module")
def shell():
    sh = globalipapp.get_ipython()
    sh.run_cell("from cudalab._kernels.spin import gpu_sleep\nimport cudalab, itertools",
                store_history=False)
    # cudalab's Ctrl-C wrapper registers its own pre_run_cell hook with the shell the first
    # time it is installed after the shell exists (ipykernel resets SIGINT per request); it
    # is not the extension's, so let it be there before the tests count the extension's hooks
    from cudalab import _interrupts

    _interrupts.install()
    return sh


@pytest.fixture
def ip(shell):
    """The test shell with the extension loaded (unloaded again afterwards)."""
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")


def _magics(sh) -> CudaLabMagics:
    return sh.magics_manager.registry["CudaLabMagics"]


def run(sh, src, silent=False):
    """Run a cell; (ExecutionResult, stdout, [display text/plain...], [display html...])."""
    with capture_output() as cap:
        r = sh.run_cell(src, store_history=True, silent=silent)
    texts = [o.data.get("text/plain", "") for o in cap.outputs]
    htmls = [o.data.get("text/html", "") for o in cap.outputs]
    return r, cap.stdout, texts, htmls


def timed(sh, src):
    """Run a %cuda_timed cell with -o -q added; the CudaTimedResult."""
    line, _, body = src.partition("\n")
    assert line.startswith("%")
    head = line.split(None, 1)
    line = f"{head[0]} -o -q {head[1] if len(head) > 1 else ''}"
    r, out, _t, _h = run(sh, line + ("\n" + body if body else ""))
    if not r.success:
        raise r.error_in_exec or r.error_before_exec
    assert isinstance(r.result, CudaTimedResult), out
    return r.result


def our_callbacks(sh, m):
    return [(ev, fn) for ev, fns in sh.events.callbacks.items() for fn in fns
            if getattr(fn, "__self__", None) is m
            or getattr(getattr(fn, "__self__", None), "magics", None) is m]


# =============================================================================== options
def test_parse_options_basic():
    o = parse_options("-n 10 -r 3 -w 2 x = f(1)")
    assert (o.number, o.repeat, o.warmup, o.stmt) == (10, 3, 2, "x = f(1)")
    assert o.repeat_mode
    o = parse_options("-n10 --max-time=2.5 --cold --kernels -oq -d all -p 4 -v res")
    assert (o.number, o.max_time, o.cold, o.kernels, o.output, o.quiet) == (10, 2.5, True, True,
                                                                            True, True)
    assert (o.device, o.precision, o.var, o.stmt) == ("all", 4, "res", "")
    assert not parse_options("--kernels f()").repeat_mode
    assert parse_options("--max-time 3 f()").repeat_mode
    assert parse_options("  ").stmt == ""


def test_parse_options_statement_kept_verbatim():
    assert parse_options("-1 + 2").stmt == "-1 + 2"
    assert parse_options("-- -x + 1").stmt == "-x + 1"
    assert parse_options("-q  a = '-n 5'  ").stmt == "a = '-n 5'"
    assert parse_options("--no-raise-error f(-n)").no_raise


@pytest.mark.parametrize("line", ["-n 0", "-n x", "-r -1", "-w -1", "--max-time 0", "-v 1x",
                                  "-n", "--bogus f()", "-z f()"])
def test_parse_options_errors(line):
    with pytest.raises(UsageError):
        parse_options(line)


def test_parse_devices():
    cudalab.init()
    assert parse_devices(None) == [cudalab.current_device()]
    assert parse_devices("all") == list(range(cudalab.device_count()))
    assert parse_devices("cuda:0") == [0]
    assert parse_devices("0,0") == [0]
    if cudalab.device_count() >= 2:
        assert parse_devices("0, cuda:1") == [0, 1]
    with pytest.raises(UsageError):
        parse_devices("99")
    with pytest.raises(UsageError):
        parse_devices("gpu3")


def test_nice_ceil_and_formatting():
    assert [_nice_ceil(x) for x in (0.3, 1, 1.5, 3, 7, 11, 240, 5000)] == [1, 1, 2, 5, 10, 20,
                                                                           500, 5000]
    assert format_time(0.0012345) == "1.23 ms"
    assert format_time(2.5e-6) == "2.5 µs"
    assert format_time(3e-9, 2) == "3 ns"
    assert format_time(None) == "n/a"
    assert format_time(75.0).startswith("1 min")
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 20, signed=True) == "+3.0 MiB"
    assert format_bytes(-512) == "-512 B"
    assert parse_size("1048576") == 1 << 20
    assert parse_size("1MiB") == parse_size("1 mib") == 1 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("64 KiB") == 65536
    assert parse_size("1g") == 1 << 30  # one parser: "1g" is 2**30 in --threshold too
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


# =============================================================================== load/unload
def test_load_unload_clean_and_idempotent(shell):
    threads_before = set(threading.enumerate())
    n_pre = len(shell.events.callbacks["pre_run_cell"])
    shell.run_line_magic("load_ext", "cudalab")
    m = _magics(shell)
    assert load_ipython_extension(shell) is m  # a second load: same instance, no new hooks
    assert len(shell.events.callbacks["pre_run_cell"]) == n_pre + 1
    assert "cuda_timed" in shell.magics_manager.magics["line"]
    assert "cuda_timed" in shell.magics_manager.magics["cell"]
    assert "cuda_memory" in shell.magics_manager.magics["line"]
    assert m in shell.configurables
    run(shell, "%cuda_memory watch on")
    run(shell, "x_ = 1")
    run(shell, "%cuda_memory mark")
    assert our_callbacks(shell, m)
    shell.run_line_magic("unload_ext", "cudalab")
    assert "cuda_timed" not in shell.magics_manager.magics["line"]
    assert "cuda_timed" not in shell.magics_manager.magics["cell"]
    assert "cuda_memory" not in shell.magics_manager.magics["line"]
    assert m not in shell.configurables
    assert not our_callbacks(shell, m)
    assert len(shell.events.callbacks["pre_run_cell"]) == n_pre
    assert m._memory.watch is None and not m._memory.marks
    assert set(threading.enumerate()) <= threads_before | {threading.current_thread()}
    unload_ipython_extension(shell)  # idempotent
    r, out, _t, _h = run(shell, "y_ = 2")
    assert "cudalab watch" not in out
    # and it loads again
    shell.run_line_magic("load_ext", "cudalab")
    assert _magics(shell) is not m
    shell.run_line_magic("reload_ext", "cudalab")
    assert len(shell.events.callbacks["pre_run_cell"]) == n_pre + 1
    shell.run_line_magic("unload_ext", "cudalab")
    assert len(shell.events.callbacks["pre_run_cell"]) == n_pre


_CALLBACKS_RESTORED = """
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()

def callbacks():
    return {event: list(fns) for event, fns in ip.events.callbacks.items()}

def cudalab_hooks():
    return sorted(f"{event}:{getattr(fn, '__module__', '')}" for event, fns in
                  ip.events.callbacks.items() for fn in fns
                  if str(getattr(fn, "__module__", "")).startswith("cudalab"))

before = callbacks()
ip.run_line_magic("load_ext", "cudalab")  # a fresh shell: this imports cudalab
loaded = cudalab_hooks()
ip.run_cell("import cudalab\\nx = cudalab.zeros(4)\\ny = x + 1")
ip.run_line_magic("unload_ext", "cudalab")
print("fresh", callbacks() == before, cudalab_hooks(), loaded)
ip.run_line_magic("load_ext", "cudalab")  # loaded again: every hook is back
again = cudalab_hooks()
ip.run_line_magic("unload_ext", "cudalab")
print("again", callbacks() == before, again == loaded)
"""

_CALLBACKS_KEPT = """
import cudalab  # imported before the extension: its Ctrl-C hook is not the extension's
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
cudalab._interrupts.install()
before = {event: list(fns) for event, fns in ip.events.callbacks.items()}
ip.run_line_magic("load_ext", "cudalab")
ip.run_cell("x = cudalab.zeros(4)")
ip.run_line_magic("unload_ext", "cudalab")
print("kept", {event: list(fns) for event, fns in ip.events.callbacks.items()} == before,
      any(fn.__module__ == "cudalab._interrupts" for fn in ip.events.callbacks["pre_run_cell"]))
"""


def test_unload_restores_ipythons_callbacks_exactly():
    """Issue 36 item 26: %load_ext then %unload_ext leaves IPython's callbacks as they were:
    in a fresh shell no cudalab callback is left (the Ctrl-C hook that importing cudalab
    for the extension registered included); one that was there before the load stays."""
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", _CALLBACKS_RESTORED], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh, again = r.stdout.splitlines()[-2:]
    assert fresh.startswith("fresh True [] [") and "pre_run_cell:cudalab._interrupts" in fresh, fresh
    assert again == "again True True", again
    r = subprocess.run([sys.executable, "-c", _CALLBACKS_KEPT], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "kept True True", r.stdout


def test_load_does_not_touch_cuda_or_numpy():
    code = ("import sys\nfrom IPython.core.interactiveshell import InteractiveShell\n"
            "ip = InteractiveShell.instance()\nimport time; t = time.perf_counter()\n"
            "ip.run_line_magic('load_ext', 'cudalab')\ndt = time.perf_counter() - t\n"
            "import cudalab.devices as d\n"
            "print('numpy' in sys.modules, d.is_initialized(), 'cudalab.memory' in sys.modules, dt)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr
    numpy_loaded, initialized, memory_loaded, dt = r.stdout.split()
    assert (numpy_loaded, initialized, memory_loaded) == ("False", "False", "False")
    assert float(dt) < 1.0  # the benchmark checks the 300 ms budget on the GPU machine


def test_config_file_settings_apply_at_load(shell):
    shell.config.CudaLabMagics.repeat = 4  # what c.CudaLabMagics.repeat = 4 in ipython_config.py does
    try:
        shell.run_line_magic("load_ext", "cudalab")
        assert _magics(shell).repeat == 4
    finally:
        shell.run_line_magic("unload_ext", "cudalab")
        del shell.config.CudaLabMagics["repeat"]


def test_config_traits(ip):
    r, out, _t, _h = run(ip, "%config CudaLabMagics")
    assert "repeat" in out and "watch_threshold" in out
    run(ip, "%config CudaLabMagics.repeat = 3")
    run(ip, "%config CudaLabMagics.warmup = 0")
    try:
        res = timed(ip, "%%cuda_timed -n 1\ngpu_sleep(100_000)")
        assert res.count == 3 and res.warmup == 0
    finally:
        run(ip, "%config CudaLabMagics.repeat = 7")
        run(ip, "%config CudaLabMagics.warmup = 1")


# =============================================================================== single mode
def test_single_mode_last_expression_is_output(ip):
    r, out, texts, htmls = run(ip, "%%cuda_timed\nzz = 20\nzz * 2 + 2")
    assert r.success and r.result == 42 and ip.user_ns["zz"] == 20
    report = "\n".join(texts)
    assert "GPU time" in report and "CPU" in report and "wall" in report
    assert ("simulated" in report) == _sim()
    assert "<table" in htmls[0]
    r, _o, _t, _h = run(ip, "%cuda_timed 6 * 7")
    assert r.result == 42
    r, _o, _t, _h = run(ip, "%%cuda_timed\nww = 1")
    assert r.result is None and ip.user_ns["ww"] == 1


def test_single_mode_semicolon_silences(ip):
    r, _o, _t, _h = run(ip, "%%cuda_timed\n1 + 1;")
    assert r.success and r.result is None


def test_single_mode_measures_gpu_time(ip):
    res = timed(ip, "%%cuda_timed\ngpu_sleep(20_000_000)\n7")
    assert res.mode == "single" and res.value == 7 and res.count == 1
    assert 0.019 <= res.median < 0.5
    assert res.wall_time >= res.median * 0.9
    assert res.simulated == _sim()


def test_single_mode_ipython_syntax_and_setup_line(ip):
    run(ip, "setup_calls = []")
    r, _o, _t, _h = run(ip, "%%cuda_timed setup_calls.append(1); q_ = 3\n"
                            "vv = %cuda_timed -q q_ * 2\nvv")
    assert r.success and r.result == 6
    assert ip.user_ns["setup_calls"] == [1]


def test_single_mode_exception_propagates(ip):
    r, out, texts, _h = run(ip, "%%cuda_timed\nraise ValueError('boom')")
    assert isinstance(r.error_in_exec, ValueError)
    assert "GPU time" in "\n".join(texts)
    assert "raised ValueError" in "\n".join(texts)
    r, _o, texts, _h = run(ip, "%%cuda_timed --no-raise-error\nraise KeyError('k')")
    assert r.success and "raised KeyError" in "\n".join(texts)
    r, _o, _t, _h = run(ip, "%%cuda_timed\n1 +")
    assert not r.success  # a SyntaxError, shown like any cell's


def test_nested_timing_keeps_outer_events(ip):
    res = timed(ip, "%%cuda_timed\ngpu_sleep(10_000_000)\n"
                    "inner_ = %cuda_timed -o -q -n 1 -r 2 -w 1 gpu_sleep(5_000_000)")
    assert ip.user_ns["inner_"].count == 2
    assert res.median >= 0.024  # 10 ms + 3 x 5 ms: the inner run did not reuse the outer events


def test_side_stream_is_joined(ip):
    res = timed(ip, "%%cuda_timed\nss_ = cudalab.Stream()\ngpu_sleep(20_000_000, stream=ss_)")
    assert res.median >= 0.019


def test_side_stream_in_repeat_mode(ip):
    run(ip, "ss2_ = cudalab.Stream()")
    res = timed(ip, "%%cuda_timed -n 1 -r 3 -w 1\ngpu_sleep(10_000_000, stream=ss2_)")
    assert res.median >= 0.0095
    assert not any("not timed" in w or "first seen" in w for w in res.warnings)
    run(ip, "ss3_ = cudalab.Stream()")
    res = timed(ip, "%%cuda_timed -n 1 -r 3 -w 0\ngpu_sleep(1_000_000, stream=ss3_)")
    assert any("first seen while measuring" in w for w in res.warnings)


def test_other_device_warning_and_all_devices(ip, two_devices):
    res = timed(ip, "%%cuda_timed -d 0\n"
                    "with cudalab.device(1):\n    gpu_sleep(1_000_000)")
    assert any("cuda:1" in w and "-d all" in w for w in res.warnings)
    res = timed(ip, "%%cuda_timed -d all\n"
                    "with cudalab.device(1):\n    gpu_sleep(10_000_000)")
    every = tuple(range(cudalab.device_count()))  # "all": every device of the machine
    assert res.devices == every and res.gpu_times.shape == (len(every), 1)
    assert res.device_stats(1)["median"] >= 0.009
    assert res.median >= 0.009  # the slowest device
    res = timed(ip, "%%cuda_timed -d 1\nwith cudalab.device(1):\n    gpu_sleep(5_000_000)")
    assert res.devices == (1,) and res.median >= 0.0045


# =============================================================================== repeat mode
def test_repeat_mode_counts_and_per_loop_times(ip):
    res = timed(ip, "%%cuda_timed -n 2 -r 4 -w 0\ngpu_sleep(2_000_000)")
    assert (res.mode, res.loops, res.repeats, res.count) == ("repeat", 2, 4, 4)
    assert res.gpu_times.shape == (1, 4) and res.cpu_times.shape == (4,)
    assert 0.0019 <= res.median < 0.05
    assert res.min <= res.median <= res.max
    assert res.value is None
    r, out, texts, _h = run(ip, "%cuda_timed -n 1 -r 3 gpu_sleep(100_000)")
    assert r.result is None and "per loop" in texts[0] and "3 repeats × 1 loop" in texts[0]


@pytest.mark.parametrize("n", [1, 3])
def test_the_body_runs_n_times_per_repeat_and_once_per_warmup(ip, n):
    """-n 1 runs the body without the inner loop (a template of its own): the same count."""
    run(ip, "runs_ = [0]")
    res = timed(ip, f"%%cuda_timed -n {n} -r 4 -w 2\nruns_[0] += 1")
    assert res.loops == n and res.repeats == 4
    assert ip.user_ns["runs_"] == [4 * n + 2]


def test_setup_untimed_and_run_before_each_repeat(ip):
    run(ip, "calls_ = []")
    res = timed(ip, "%%cuda_timed -n 1 -r 3 -w 0 calls_.append(1); gpu_sleep(30_000_000); k_ = 5\n"
                    "assert k_ == 5\ngpu_sleep(1_000_000)")
    assert ip.user_ns["calls_"] == [1, 1, 1]
    assert res.median < 0.015  # the 30 ms setup is not in the time
    assert "k_" not in ip.user_ns  # like %timeit, setup names are local to the timing function


def test_body_compiled_once(ip, monkeypatch):
    calls = []
    orig = ip.compile.ast_parse

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(ip.compile, "ast_parse", counting)
    timed(ip, "%%cuda_timed -n 10 -r 5 -w 3\nx_ = 1 + 1")
    assert len(calls) <= 3  # the magic's own line, the setup and the body: not 80 re-parses


def test_auto_range(ip):
    m = _magics(ip)
    old = m.min_repeat_time
    m.min_repeat_time = 0.02
    try:
        res = timed(ip, "%%cuda_timed -r 3\ngpu_sleep(1_000_000)")
    finally:
        m.min_repeat_time = old
    assert res.loops >= 10 and res.loops == _nice_ceil(res.loops)
    assert res.loops * res.median >= 0.015
    res = timed(ip, "%%cuda_timed -r 2\npass")
    assert res.loops >= 10_000  # an empty body needs many loops to fill 0.2 s


def test_max_time_stops_early(ip):
    res = timed(ip, "%%cuda_timed -n 1 -r 50 -w 0 --max-time 0.3\ngpu_sleep(50_000_000)")
    assert 1 <= res.count < 50
    assert any("stopped after" in w for w in res.warnings)


def test_warnings_for_outliers(ip):
    run(ip, "it_ = itertools.count()")
    res = timed(ip, "%%cuda_timed -n 1 -r 6 -w 0\n"
                    "gpu_sleep(40_000_000 if next(it_) in (0, 1) else 1_000_000)")
    assert res.max > 4 * res.min
    assert any("slowest repeat" in w for w in res.warnings)
    assert any("IQR" in w for w in res.warnings)
    assert "warning:" in res.report()


def test_repeat_exception_propagates_and_state_is_restored(ip):
    import gc

    from cudalab._internal import launch_observers

    r, _o, _t, _h = run(ip, "%%cuda_timed -n 2 -r 2\nraise RuntimeError('inner')")
    assert isinstance(r.error_in_exec, RuntimeError)
    assert gc.isenabled() and not launch_observers
    r, _o, _t, _h = run(ip, "%%cuda_timed -n 2 -r 2\nreturn 5")
    assert not r.success  # refused like a bare "return" at top level


def test_line_mode_in_function_sees_locals(ip):
    r, _o, _t, _h = run(ip, "def f_(n):\n    v = n * 2\n"
                            "    return get_ipython().run_line_magic('cuda_timed', '-o -q -n 2 -r 2 v + 1')\n"
                            "res_ = f_(3)")
    assert r.success and ip.user_ns["res_"].count == 2


def test_output_var_and_quiet(ip):
    r, out, texts, _h = run(ip, "%cuda_timed -q -v saved_ -n 1 -r 2 pass")
    assert r.result is None and texts == [] and out == ""
    assert isinstance(ip.user_ns["saved_"], CudaTimedResult)


# =============================================================================== --cold / --kernels
def test_cold_flush(ip):
    m = _magics(ip)
    reserved = cm.memory_reserved(0)
    res = timed(ip, "%%cuda_timed --cold -n 1 -r 3\ngpu_sleep(100_000)")
    l2 = cudalab.get_device_properties(0).L2_cache_size
    assert res.cold and res.flush_bytes == {0: int(2 * l2)}
    assert "L2 flushed" in res.report()
    assert m._flush._bufs
    assert cm.memory_reserved(0) == reserved  # the buffer is not the caching allocator's
    res = timed(ip, "%%cuda_timed --cold\ngpu_sleep(100_000)")  # single mode flushes too
    assert res.cold
    ip.run_line_magic("unload_ext", "cudalab")
    assert not m._flush._bufs  # freed on unload
    ip.run_line_magic("load_ext", "cudalab")


def test_kernels_single_and_repeat(ip):
    """The fallback: cudalab's own launches (CUPTI switched off, as where it is missing)."""
    _magics(ip).cupti = False
    res = timed(ip, "%%cuda_timed --kernels\ngpu_sleep(2_000_000)\ngpu_sleep(3_000_000)")
    (row,) = res.kernels
    assert row["name"] == "cudalab_spin" and row["count"] == 2 and row["device"] == 0
    assert 0.0045 <= row["gpu_time"] < 0.1
    assert "cudalab's own launches" in res.kernels_note and ("simulator" in res.kernels_note) == _sim()
    assert _sim() or "CUPTI is off" in res.kernels_note
    assert row["source"] == "events" and row["kind"] == "kernel"
    assert "cudalab_spin" in res.report() and "cudalab_spin" in res._repr_html_()
    res = timed(ip, "%%cuda_timed --kernels -n 3 -r 2\ngpu_sleep(100_000)")
    (row,) = res.kernels
    assert row["count"] == 1 and "one extra run" in res.kernels_note
    res = timed(ip, "%%cuda_timed --kernels\nx_ = 1")
    assert res.kernels == [] and "No cudalab kernel" in res.kernels_note


# the CUPTI path of --kernels (and the fallback forced where CUPTI is installed): test_kernels.py


# =============================================================================== result object
def test_result_object():
    g = np.array([[1e-3, 1.1e-3, 0.9e-3, 1.05e-3, 5e-3]])
    r = CudaTimedResult(mode="repeat", loops=10, repeats=5, warmup=1, devices=(0,),
                        gpu_times=g, cpu_times=[2e-5] * 5, simulated=True,
                        nvml_before={0: {"clock_rate": 1000, "temperature": 40,
                                         "power_draw": 100000}},
                        nvml_after={0: {"clock_rate": 1980, "temperature": 50,
                                        "power_draw": 300000}})
    assert r.median == pytest.approx(1.05e-3) and r.min == pytest.approx(0.9e-3)
    assert r.max == pytest.approx(5e-3) and r.count == 5
    assert r.iqr == pytest.approx(np.percentile(g, 75) - np.percentile(g, 25))
    assert r.all_runs == pytest.approx(g[0] * 10)
    assert set(r.stats) >= {"median", "iqr", "min", "max", "count", "mean", "std"}
    df = r.to_frame()
    assert list(df.columns) == ["repeat", "device", "gpu_time", "cpu_time", "loops"]
    assert len(df) == 5 and df["gpu_time"].max() == pytest.approx(5e-3)
    text = pretty(r)
    assert "1.05 ms" in text and "1000 → 1980 MHz" in text and "simulated" in text
    assert "<table" in r._repr_html_() and "1.05 ms" in r._repr_html_()
    assert "CudaTimedResult" in repr(r)
    json.dumps(r.to_dict())
    r2 = CudaTimedResult(mode="repeat", loops=1, repeats=2, warmup=0, devices=(0, 1),
                         gpu_times=[[1e-3, 2e-3], [3e-3, 1e-3]], cpu_times=[1e-4, 1e-4])
    assert list(r2.times) == [3e-3, 2e-3]  # the slowest device per repeat
    assert len(r2.to_frame()) == 4 and "cuda:1" in r2.report()


# =============================================================================== %cuda_memory
def test_memory_summary(ip):
    run(ip, "buf_ = cudalab.empty((1 << 20,), dtype='uint8')")
    r, out, texts, htmls = run(ip, "%cuda_memory")
    assert r.success and r.result is None
    text = texts[0]
    for row in ("Allocated memory", "GPU reserved memory", "from large pool", "Tot Freed",
                "OOMs: 0", "device free / total", "reserved - allocated"):
        assert row in text, row
    assert ("simulated" in text) == _sim()
    assert "<table" in htmls[0] and "device free / total" in htmls[0]
    r, out, texts, _h = run(ip, "%cuda_memory summary -d cuda:0")
    assert "cuda:0" in texts[0]
    run(ip, "del buf_")


def test_memory_stats_frame(ip):
    r, _o, _t, _h = run(ip, "%cuda_memory stats")
    df = r.result
    assert df.shape == (cudalab.device_count(), 122)
    r, _o, _t, _h = run(ip, "%cuda_memory stats -d 0")
    assert list(r.result.index) == [0]


def test_mark_diff_with_scoped_peak(ip):
    r, _o, _t, _h = run(ip, "%cuda_memory diff -d 0")
    assert isinstance(r.error_in_exec, UsageError) or not r.success
    run(ip, "%cuda_memory mark")
    peak_before = cm.max_memory_allocated(0)
    run(ip, "t1_ = cudalab.empty((8 << 20,), dtype='uint8'); del t1_\n"
            "t2_ = cudalab.empty((2 << 20,), dtype='uint8')")
    r, out, texts, htmls = run(ip, "%cuda_memory diff")
    text = texts[0]
    assert "+2.0 MiB" in text and "peak allocated since the mark" in text
    assert "+8.0 MiB above the mark" in text
    assert "<table" in htmls[0]
    assert cm.max_memory_allocated(0) >= peak_before  # nothing was reset
    run(ip, "del t2_")


def test_reset_peaks_and_empty_cache(ip):
    run(ip, "t3_ = cudalab.empty((4 << 20,), dtype='uint8'); del t3_")
    assert cm.max_memory_allocated(0) > cm.memory_allocated(0)
    r, out, _t, _h = run(ip, "%cuda_memory reset-peaks")
    assert "reset" in out and cm.max_memory_allocated(0) == cm.memory_allocated(0)
    r, out, _t, _h = run(ip, "%cuda_memory empty-cache")
    assert "released" in out and r.success


def test_watch_lines_threshold_and_silent(ip):
    r, out, _t, _h = run(ip, "%cuda_memory watch on")
    assert "on" in out
    r, out, _t, _h = run(ip, "w1_ = cudalab.empty((3 << 20,), dtype='uint8')")
    assert f"[cudalab watch cuda:0{_SIM_TAG()}] Δallocated +3.0 MiB" in out
    assert "GPU " in out and "wall" in out
    r, out, _t, _h = run(ip, "del w1_\nw2_ = cudalab.empty((5 << 20,), dtype='uint8'); del w2_")
    assert "Δallocated -3.0 MiB" in out and "(+2.0 MiB in cell)" in out
    r, out, _t, _h = run(ip, "w3_ = cudalab.empty((1 << 20,), dtype='uint8')", silent=True)
    assert "cudalab watch" not in out
    run(ip, "del w3_")
    r, out, _t, _h = run(ip, "%cuda_memory watch on --threshold 2MiB")
    assert "already on" in out
    r, out, _t, _h = run(ip, "w4_ = cudalab.empty((1 << 10,), dtype='uint8')")
    assert "cudalab watch" not in out
    r, out, _t, _h = run(ip, "w5_ = cudalab.empty((4 << 20,), dtype='uint8')")
    assert "Δallocated +4.0 MiB" in out
    r, out, _t, _h = run(ip, "gpu_sleep(20_000_000)")
    assert "cudalab watch" not in out  # no memory change above the threshold
    run(ip, "del w4_, w5_")
    r, out, _t, _h = run(ip, "%cuda_memory watch off")
    assert "off" in out
    r, out, _t, _h = run(ip, "w6_ = cudalab.empty((4 << 20,), dtype='uint8'); del w6_")
    assert "cudalab watch" not in out


def test_watch_gpu_time_and_global_peak_untouched(ip):
    run(ip, "big_ = cudalab.empty((16 << 20,), dtype='uint8'); del big_")
    global_peak = cm.max_memory_allocated(0)
    run(ip, "%cuda_memory watch on")
    r, out, _t, _h = run(ip, "gpu_sleep(20_000_000)")
    line = [x for x in out.splitlines() if "cudalab watch" in x][0]
    gpu = line.split("| GPU ")[1].split(" |")[0]
    assert gpu.endswith(" ms") and 19 <= float(gpu.split()[0]) < 500
    run(ip, "%cuda_memory watch off")
    assert cm.max_memory_allocated(0) == global_peak


def test_watch_scoped_peaks_nest(ip):
    run(ip, "%cuda_memory watch on")
    base = cm.memory_allocated(0)
    r, out, _t, _h = run(ip, "with cudalab.memory.peak_scope() as inner_:\n"
                             "    p_ = cudalab.empty((6 << 20,), dtype='uint8'); del p_\n"
                             "q_ = cudalab.empty((1 << 20,), dtype='uint8'); del q_")
    run(ip, "%cuda_memory watch off")
    assert ip.user_ns["inner_"].peak_allocated == base + (6 << 20)
    assert "(+6.0 MiB in cell)" in out


def test_watch_and_mark_interleaved(ip):
    run(ip, "%cuda_memory watch on")
    r, out, _t, _h = run(ip, "m1_ = cudalab.empty((8 << 20,), dtype='uint8'); del m1_\n"
                             "get_ipython().run_line_magic('cuda_memory', 'mark')\n"
                             "m2_ = cudalab.empty((1 << 20,), dtype='uint8'); del m2_")
    run(ip, "%cuda_memory watch off")
    assert "(+8.0 MiB in cell)" in out


def test_a_failing_timed_cell_and_the_history_name_the_cell_ipython_numbers(ip):
    """Issue 36 item 9: code of In[N] is 'Cell In[N]' in %%cuda_timed's traceback and 'In[N]'
    in history's cell column, though IPython 9 advanced ``execution_count`` to N+1 before
    the cell ran."""
    r, out, _t, _h = run(ip, "%%cuda_timed\nx_ = 1\n1/0")
    n = r.execution_count
    assert isinstance(r.error_in_exec, ZeroDivisionError)
    assert f"Cell In[{n}], line 2" in out and f"Cell In[{n + 1}]" not in out, out
    run(ip, "%cuda_memory history start")
    try:
        r, _o, _t, _h = run(ip, "h9_ = cudalab.empty((999,), dtype='uint8'); del h9_")
        n = r.execution_count
    finally:
        run(ip, "%cuda_memory history stop")
    df = run(ip, "%cuda_memory history frame")[0].result
    cells = set(df.loc[df["size"] == 999, "cell"].astype(str))
    assert f"In[{n}]" in cells and f"In[{n + 1}]" not in cells, cells


def test_history_start_stop_save_frame(ip, tmp_path):
    r, out, _t, _h = run(ip, "%cuda_memory history start --max-entries 1000")
    assert "recording" in out and "max_entries=1,000" in out
    r, out, _t, _h = run(ip, "%cuda_memory history start")
    assert "already recording" in out
    r, out, _t, _h = run(ip, "%cuda_memory history")
    assert "recording (" in out
    run(ip, "h1_ = cudalab.empty((1000,), dtype='uint8'); del h1_")
    r, out, _t, _h = run(ip, "%cuda_memory history stop")
    assert "stopped" in out
    r, _o, _t, _h = run(ip, "%cuda_memory history frame")
    df = r.result
    assert len(df) >= 2 and set(df["action"].astype(str)) >= {"alloc", "free_requested"}
    assert any(str(c).startswith("In[") for c in df["cell"].dropna())
    for name in ("h.pickle", "h.csv", "h.json"):
        r, out, _t, _h = run(ip, f"%cuda_memory history save {tmp_path / name}")
        assert r.success and (tmp_path / name).stat().st_size > 0, out
    snap = cm.load_snapshot(str(tmp_path / "h.pickle"))
    assert "device_traces" in snap
    r, out, _t, _h = run(ip, "%cuda_memory history stop")
    assert "not recording" in out


def test_snapshot_and_dashboard(ip, tmp_path):
    run(ip, "s1_ = cudalab.empty((1 << 20,), dtype='uint8')")
    r, _o, _t, _h = run(ip, "%cuda_memory snapshot dict")
    assert isinstance(r.result, dict) and "segments" in r.result
    assert "segments" in repr(r.result) and len(repr(r.result)) < 200
    path = tmp_path / "snap.pickle"
    ip.user_ns["snap_path_"] = str(path)
    r, out, _t, _h = run(ip, "%cuda_memory snapshot {snap_path_}")  # variables expand
    assert r.success and "memory_viz" in out and cm.load_snapshot(str(path))["segments"]
    r, out, _t, _h = run(ip, "%cuda_memory snapshot view {snap_path_}")
    from cudalab.widgets import SnapshotViewer

    assert r.success and isinstance(r.result, SnapshotViewer), out
    r, out, _t, _h = run(ip, "%cuda_memory snapshot")  # the live snapshot, in the viewer
    assert r.success and isinstance(r.result, SnapshotViewer), out
    r.result.close()
    from cudalab.widgets import SnapshotExplorer

    r, out, _t, _h = run(ip, "%cuda_memory explore {snap_path_} {snap_path_}")  # diff mode
    assert r.success and isinstance(r.result, SnapshotExplorer), out
    r.result.wait(60)
    assert r.result.error is None and r.result.diff_result is not None
    r.result.close()
    r, out, _t, _h = run(ip, "%cuda_memory explore")  # the recorded history
    assert r.success and isinstance(r.result, SnapshotExplorer), out
    r.result.close()
    run(ip, "del s1_")


def test_dashboard_or_clear_message(shell):
    """With the widgets feature: a dashboard whose sampler thread stops on unload; without it
    a clear message."""
    threads_before = set(threading.enumerate())
    shell.run_line_magic("load_ext", "cudalab")
    try:
        r, out, _t, _h = run(shell, "%cuda_memory dashboard -d 0")
        try:
            from cudalab.widgets import MemoryDashboard
        except ImportError:
            MemoryDashboard = None  # noqa: N806
        if MemoryDashboard is None:
            assert r.success and "not built yet" in out and r.result is None
            return
        assert r.success and isinstance(r.result, MemoryDashboard), out
        dash = r.result
    finally:
        shell.run_line_magic("unload_ext", "cudalab")
    assert dash._closed
    for th in set(threading.enumerate()) - threads_before:
        th.join(timeout=2)
        assert not th.is_alive(), th


@pytest.mark.parametrize("line", ["bogus", "watch maybe", "history rewind", "-x",
                                  "history save", "watch on --threshold lots"])
def test_memory_usage_errors(ip, line):
    r, _o, _t, _h = run(ip, f"%cuda_memory {line}")
    assert isinstance(r.error_in_exec, UsageError)


# =============================================================================== terminal
def test_plain_terminal_ipython():
    script = ("%load_ext cudalab\nfrom cudalab._kernels.spin import gpu_sleep\n"
              "%cuda_timed gpu_sleep(1_000_000)\n%cuda_memory watch on\n"
              "import cudalab; a = cudalab.empty((1 << 20,), dtype='uint8')\n"
              "%unload_ext cudalab\nexit\n")
    env = dict(os.environ, CUDALAB_SIMULATOR="1")
    r = subprocess.run([sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner",
                        "--HistoryManager.hist_file=:memory:", "--colors=nocolor"],
                       input=script, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GPU time" in r.stdout and "simulated" in r.stdout
    assert "[cudalab watch cuda:0, simulated] Δallocated +1.0 MiB" in r.stdout


# =============================================================================== GPU
def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.gpu
def test_gpu_single_mode_time_of_known_kernel(ip):
    """The cell's GPU time is the kernel's: at least the 10 ms it spins, and no more than
    an event pair around the same kernel measures (the spin ends at the first
    ``%globaltimer`` update past 10 ms, so on a host whose timer updates coarsely the kernel
    itself runs a little longer than 10 ms: the event pair is the oracle, not the nominal
    figure)."""
    from cudalab._kernels.spin import gpu_sleep

    reference = []
    for _ in range(5):
        start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
        start.record()
        gpu_sleep(10 * MS)
        end.record()
        end.synchronize()
        reference.append(start.elapsed_time(end) / 1e3)
    res = timed(ip, "%%cuda_timed\ngpu_sleep(10_000_000)")
    assert 0.0099 <= res.median <= max(reference) * 1.01 + 20e-6, (res.median, reference)
    assert not res.simulated


@pytest.mark.gpu
def test_gpu_agreement_with_torch_events(ip):
    torch = _torch_cuda()
    from cudalab._kernels.spin import gpu_sleep

    gpu_sleep(MS)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gpu_sleep(MS)  # the legacy default stream: torch's current stream too
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    torch_median = float(np.median(times))
    res = timed(ip, "%%cuda_timed -n 1 -r 30 -w 3\ngpu_sleep(1_000_000)")
    # as with cupyx: host-synchronised event pairs include one launch latency
    assert 0.99e-3 <= res.median <= torch_median * 1.01, (res.median, torch_median)


@pytest.mark.gpu
def test_gpu_agreement_with_cupyx_benchmark(ip):
    cupyx_profiler = pytest.importorskip("cupyx.profiler")
    from cudalab._kernels.spin import gpu_sleep

    bench = cupyx_profiler.benchmark(lambda: gpu_sleep(MS), n_repeat=30, n_warmup=3)
    cupy_median = float(np.median(bench.gpu_times[0]))
    # cupyx synchronises the host before every repeat, so its start event fires before the
    # launch reaches the GPU and its median includes one launch latency (~10 us, 1.0-1.3 %
    # of this kernel on an H100); ours queues the events with the work. Both bracket the
    # kernel's own 1 ms (a %globaltimer spin): ours must lie between it and cupyx's + 1 %.
    for cell in ("%%cuda_timed -n 1 -r 30 -w 3\ngpu_sleep(1_000_000)",
                 "%%cuda_timed -n 10 -r 10\ngpu_sleep(1_000_000)"):
        res = timed(ip, cell)
        assert 0.99e-3 <= res.median <= cupy_median * 1.01, (res.median, cupy_median)


@pytest.mark.gpu
def test_gpu_cold_raises_time_of_l2_resident_work(ip):
    """An 8 MiB -> 8 MiB pass fits in L2: flushing L2 first must make it slower. The setup
    statement queues a 100 µs spin so the GPU is busy when the start event is recorded: no
    launch gap in either measurement."""
    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    if use_torch:
        ip.run_cell("import torch\nsrc_ = torch.ones(2 << 20, device='cuda')\n"
                    "dst_ = torch.empty_like(src_)\nop_ = lambda: torch.add(src_, 1.0, out=dst_)",
                    store_history=False)
    else:
        ip.run_cell("src_ = cudalab.zeros((2 << 20,), dtype='float32')\n"
                    "dst_ = cudalab.empty((2 << 20,), dtype='float32')\n"
                    "op_ = lambda: dst_.copy_(src_)", store_history=False)
    warm = timed(ip, "%%cuda_timed -n 1 -r 100 -w 10 gpu_sleep(100_000)\nop_()")
    cold = timed(ip, "%%cuda_timed --cold -n 1 -r 100 -w 10 gpu_sleep(100_000)\nop_()")
    assert cold.median > warm.median * 1.05, (warm.report(), cold.report())
    ip.run_cell("del src_, dst_, op_", store_history=False)


@pytest.mark.gpu
def test_gpu_kernels_lists_a_cudalab_kernel(ip):
    res = timed(ip, "%%cuda_timed --kernels\ngpu_sleep(2_000_000)")
    names = {k["name"] for k in res.kernels}
    assert any("cudalab_spin" in n for n in names), res.kernels_note
    row = next(k for k in res.kernels if "cudalab_spin" in k["name"])
    assert row["count"] == 1 and 0.0019 <= row["gpu_time"] <= 0.003


# =============================================================================== driver calls
@pytest.fixture
def driver_calls():
    """A Counter of the driver calls made through the backend and the event fast paths
    (``Event.record``/``query`` and the timer's records go through the fast paths)."""
    from cudalab.testing import count_calls

    cudalab.init()
    with count_calls() as counts:
        yield counts


def _per_repeat(sh, counts, cell, r1=40, r2=240):
    """Driver calls per repeat of ``cell`` (a format string with {r}): the difference
    between two repeat counts, after a first run that fills the event pool."""
    timed(sh, cell.format(r=r2))
    totals = []
    for r in (r1, r2):
        counts.clear()
        res = timed(sh, cell.format(r=r))
        assert res.count == r
        totals.append(dict(counts))
    keys = set(totals[0]) | set(totals[1])
    return {k: (totals[1].get(k, 0) - totals[0].get(k, 0)) / (r2 - r1) for k in keys}


#: Waits per repeat allowed where none is expected per repeat: on a GPU the in-flight lag
#: starts at two repeats and doubles after each wait shorter than the GPU's latency, so a
#: run may wait a few times (log2(MAX_LAG / 2) = 4) before its empty repeats stop waiting;
#: with 200 repeats between the two runs compared, 5 waits are 0.025 per repeat.
_FEW_WAITS = 0.025


def test_driver_calls_per_repeat(ip, driver_calls):
    """Shared boundaries: repeat j runs from event j to event j + 1, so a repeat costs one
    record, and one elapsed_time after the single sync; the in-flight check queries every
    few repeats only; the events come from the pool (none created once it holds them)."""
    c = _per_repeat(ip, driver_calls, "%cuda_timed -n 1 -w 0 -r {r} pass")
    assert c.get("event_record") == 1 and c.get("event_elapsed_time") == 1, c
    # (a GPU waits only while the in-flight lag grows: a few per run, none per repeat)
    assert c.get("event_query", 0) <= 0.1 and c.get("event_synchronize", 0) <= _FEW_WAITS, c
    assert c.get("event_create", 0) == 0 and c.get("synchronize", 0) == 0, c
    # something untimed between repeats (a setup statement, a flush): a start event each
    c = _per_repeat(ip, driver_calls, "%%cuda_timed -n 1 -w 0 -r {r} x_ = 0\npass")
    assert c.get("event_record") == 2 and c.get("event_elapsed_time") == 1, c
    c = _per_repeat(ip, driver_calls, "%cuda_timed --cold -n 1 -w 0 -r {r} pass")
    assert c.get("event_record") == 2 and c.get("memset_d8_async") == 1, c
    assert c.get("event_elapsed_time") == 1, c
    # a side stream seen in warm-up: a boundary on each stream, joined when read
    run(ip, "sdc_ = cudalab.Stream()")
    c = _per_repeat(ip, driver_calls, "%cuda_timed -n 1 -w 1 -r {r} gpu_sleep(0, stream=sdc_)")
    assert c.get("event_record") == 2 and c.get("event_elapsed_time") == 3, c
    assert c.get("event_query", 0) <= 0.2 and c.get("event_synchronize", 0) <= _FEW_WAITS, c


def test_in_flight_check_waits_when_the_gpu_is_behind(ip, driver_calls, monkeypatch):
    """When the end of repeat k - lag is not done, the check waits for it and runs again
    after the next repeat; while the GPU keeps up it runs only every MAX_STRIDE repeats."""
    from cudalab import devices
    from cudalab._driver.base import STATUS_NOT_READY, FastCalls
    from cudalab.magics.event_timer import EventTimer

    c = _per_repeat(ip, driver_calls, "%cuda_timed -n 1 -w 0 -r {r} pass", 64, 640)
    waits = c.get("event_synchronize", 0)
    assert waits <= _FEW_WAITS
    # Each wait puts the stride back to 1, and it doubles back to MAX_STRIDE within
    # log2(MAX_STRIDE) + 1 queries: the queries are those, plus one per MAX_STRIDE repeats.
    # (A lent 2 x H200 host made 12 waits in 576 repeats, so 0.11 queries per repeat.)
    per_wait = EventTimer.MAX_STRIDE.bit_length()
    assert 0 < c.get("event_query", 0) <= waits * per_wait + 1.5 / EventTimer.MAX_STRIDE, c
    fast = devices.seam_fast_calls
    monkeypatch.setattr(devices, "seam_fast_calls", FastCalls(
        fast.event_record, lambda h: (STATUS_NOT_READY,), fast.stream_query,
        fast.event_elapsed_time))
    c = _per_repeat(ip, driver_calls, "%cuda_timed -n 1 -w 0 -r {r} pass")
    # one wait per repeat; on a GPU the lag the waits' lengths choose (see _between) moves
    # where the waits start by a repeat or two between the two runs compared
    assert abs(c.get("event_synchronize", 0) - 1) <= _FEW_WAITS, c
    assert c.get("event_record") == 1, c


def test_elapsed_times_read_by_handle_fall_back_to_the_checked_call(ip, monkeypatch):
    """The timer reads a repeat's GPU time through the unchecked fast path; a failed status
    makes it read every time again through the backend's checked call, which either gives
    the same times or raises the driver's error (never a time of 0)."""
    from cudalab import devices
    from cudalab._driver.base import FastCalls
    from cudalab.errors import CudaError

    fast = devices.seam_fast_calls
    seen = []

    def failing(a, b):
        seen.append(1)
        return (700, 0.0)

    monkeypatch.setattr(devices, "seam_fast_calls", FastCalls(
        fast.event_record, fast.event_query, fast.stream_query, failing))
    res = timed(ip, "%%cuda_timed -n 1 -r 4 -w 0\ncudalab.synchronize()")
    assert len(seen) == 4 and len(res.gpu_times[0]) == 4
    assert all(t > 0 for t in res.gpu_times[0])
    backend = devices.backend()

    def broken(a, b):
        raise CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access",
                        call="cuEventElapsedTime")

    monkeypatch.setattr(backend, "event_elapsed_time", broken)
    with pytest.raises(CudaError, match="cuEventElapsedTime|illegal"):
        timed(ip, "%%cuda_timed -n 1 -r 4 -w 0\npass")


def test_elapsed_times_read_in_one_batch_fall_back_to_the_checked_call(ip, monkeypatch):
    """Where the registry has ``event_elapsed_times`` (the real backend's C call, the
    simulator's loop), a run's times are read in one call of it, not one call per repeat;
    a failed status makes the timer read every time again through the checked call."""
    from cudalab import devices
    from cudalab._driver.base import FastCalls

    fast = devices.seam_fast_calls
    assert fast.event_elapsed_times is not None  # the simulator's own loop
    batches, single = [], []

    def one(a, b):
        single.append(1)
        return fast.event_elapsed_time(a, b)

    def batch(starts, ends):
        batches.append(len(starts))
        return fast.event_elapsed_times(starts, ends)

    registry = FastCalls(fast.event_record, fast.event_query, fast.stream_query, one)
    registry.event_elapsed_times = batch
    monkeypatch.setattr(devices, "seam_fast_calls", registry)
    res = timed(ip, "%%cuda_timed -n 1 -r 6 -w 0\ncudalab.synchronize()")
    assert batches == [6] and not single
    assert len(res.gpu_times[0]) == 6 and all(t > 0 for t in res.gpu_times[0])

    def failing(starts, ends):
        batches.append(len(starts))
        return (700, [])

    registry.event_elapsed_times = failing
    batches.clear()
    res = timed(ip, "%%cuda_timed -n 1 -r 4 -w 0\ncudalab.synchronize()")
    assert batches == [4] and len(res.gpu_times[0]) == 4
    assert all(t > 0 for t in res.gpu_times[0])  # read again, checked: never a time of 0


def test_in_flight_lag_grows_only_while_the_waits_are_short(ip, monkeypatch):
    """A wait on repeat k - lag that returns within the GPU's latency means nothing was
    behind: the lag doubles up to MAX_LAG. Longer waits keep two repeats in flight."""
    from cudalab import devices
    from cudalab._driver.base import STATUS_NOT_READY, FastCalls
    from cudalab.magics import event_timer as T

    timers = []
    init = T.EventTimer.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        timers.append(self)

    monkeypatch.setattr(T.EventTimer, "__init__", spy)
    fast = devices.seam_fast_calls
    monkeypatch.setattr(devices, "seam_fast_calls", FastCalls(
        fast.event_record, lambda h: (STATUS_NOT_READY,), fast.stream_query,
        fast.event_elapsed_time))
    res = timed(ip, "%%cuda_timed -n 1 -w 0 -r 200\npass")
    assert res.repeats == 200 and timers[-1]._lag == T.EventTimer.MAX_LAG
    monkeypatch.setattr(T.EventTimer, "LATENCY", -1.0)  # every wait is a GPU behind
    res = timed(ip, "%%cuda_timed -n 1 -w 0 -r 200\npass")
    assert res.repeats == 200 and timers[-1]._lag == 2


def test_long_runs_take_their_events_before_the_loop(ip, driver_calls):
    """3000 repeats take 3001 boundary events from the pool before the loop; a second run
    creates none, and every repeat gets its GPU time."""
    timed(ip, "%%cuda_timed -n 1 -r 2 -w 0\npass")  # the pool exists
    pool = _magics(ip)._event_pool
    before = sum(len(v) for v in pool._events.values())
    driver_calls.clear()
    res = timed(ip, "%%cuda_timed -n 1 -r 3000 -w 0 --max-time 60\npass")
    assert res.repeats == 3000 and len(res.gpu_times[0]) == 3000
    assert all(t >= 0 for t in res.gpu_times[0])
    assert sum(len(v) for v in pool._events.values()) - before == 3001 - 3
    assert driver_calls["event_record"] == 3001 and driver_calls["event_elapsed_time"] == 3000
    driver_calls.clear()
    timed(ip, "%%cuda_timed -n 1 -r 3000 -w 0 --max-time 60\npass")
    assert driver_calls["event_create"] == 0


def test_events_grow_in_chunks_outside_the_repeats(ip, monkeypatch):
    """Past CHUNK repeats the timer takes the next chunk between two repeats; in the shared
    mode the next repeat then starts from a fresh event, so the pause is in no repeat."""
    from cudalab.magics.event_timer import EventTimer

    take = EventTimer._take

    def slow_take(self, n):
        if self.reps:  # growth during the loop: a slow pool
            time.sleep(0.03)
        take(self, n)

    monkeypatch.setattr(EventTimer, "CHUNK", 8)
    monkeypatch.setattr(EventTimer, "_take", slow_take)
    for cell in ("%%cuda_timed -n 1 -r 30 -w 0\npass",
                 "%%cuda_timed -n 1 -r 30 -w 0 x_ = 1\npass",
                 "%%cuda_timed -n 1 -r 30 -w 0 --cold\npass"):
        res = timed(ip, cell)
        assert res.count == 30 and np.all(res.gpu_times >= 0), cell
        assert res.max < 0.02, (cell, res.gpu_times)


def test_repeat_mode_on_two_devices(ip, two_devices):
    res = timed(ip, "%%cuda_timed -d all -n 1 -r 3 -w 1\n"
                    "gpu_sleep(1_000_000)\nwith cudalab.device(1):\n    gpu_sleep(5_000_000)")
    every = tuple(range(cudalab.device_count()))  # "all": every device of the machine
    assert res.devices == every and res.gpu_times.shape == (len(every), 3)
    assert res.device_stats(1)["median"] >= 0.0045 and res.device_stats(0)["median"] >= 0.0009
    assert res.median >= 0.0045


def test_watch_waits_only_when_the_end_is_not_reached(ip, driver_calls, monkeypatch):
    """The first read of the GPU time finds the end event not reached: the watch waits for
    it (watch_sync) and reads again, or prints "GPU running" without watch_sync."""
    from cudalab import devices
    from cudalab._driver.base import STATUS_NOT_READY, FastCalls

    fast = devices.seam_fast_calls
    first = []

    def late(a, b):  # every other read: the end event not reached yet
        first.append(1)
        if len(first) % 2:
            return (STATUS_NOT_READY, 0.0)
        return fast.event_elapsed_time(a, b)

    run(ip, "%cuda_memory watch on")
    monkeypatch.setattr(devices, "seam_fast_calls", FastCalls(
        fast.event_record, fast.event_query, fast.stream_query, late))
    driver_calls.clear()
    for _ in range(4):
        r, out, _t, _h = run(ip, "gpu_sleep(200_000)")
        assert re.search(r"GPU \d", out), out
    assert driver_calls["event_synchronize"] == 4 and len(first) == 8
    _magics(ip).watch_sync = False
    try:
        r, out, _t, _h = run(ip, "pass")
        assert "GPU running" in out
    finally:
        _magics(ip).watch_sync = True
        run(ip, "%cuda_memory watch off")


def test_watch_driver_calls_per_cell(ip, driver_calls):
    """A printed line: the start and end records and one elapsed_time, plus a wait and a
    second read only when the first found the end event not reached. Under the threshold:
    the start record only (nothing waited for or read)."""
    run(ip, "%cuda_memory watch on")
    run(ip, "pass")
    driver_calls.clear()
    for _ in range(10):
        run(ip, "pass")
    calls = {k: v for k, v in driver_calls.items() if v}
    assert calls["event_record"] == 20 and 10 <= calls["event_elapsed_time"] <= 20, calls
    assert calls.get("event_synchronize", 0) == calls["event_elapsed_time"] - 10, calls
    assert set(calls) <= {"event_record", "event_elapsed_time", "event_synchronize"}
    run(ip, "%cuda_memory watch on --threshold 1MiB")
    driver_calls.clear()
    for _ in range(10):
        r, out, _t, _h = run(ip, "pass")
        assert "cudalab watch" not in out
    assert {k: v for k, v in driver_calls.items() if v} == {"event_record": 10}
    run(ip, "%cuda_memory watch off")
