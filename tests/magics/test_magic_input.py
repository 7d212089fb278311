"""The magics' input and failure paths: trailing ``# comment`` on a magic's line, clean
``UsageError`` for paths ``%cuda_memory`` can't write or read, tracebacks without the
magic's frames, Ctrl-C in repeat mode, no clock-locking advice on the simulator, and what
``%cuda_memory?`` documents.
"""

from __future__ import annotations

import gc
import os
import pickle

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

import cudalab
import cudalab.memory as cm
from cudalab.magics import CudaLabMagics
from cudalab.magics.memory_args import strip_comment
from cudalab.magics.result import CudaTimedResult
from cudalab.magics.timed import parse_options
from cudalab.magics.timed_context import clock_hints


@pytest.fixture
def ip():
    """IPython's test shell with the extension loaded (unloaded again afterwards)."""
    sh = globalipapp.get_ipython()
    cudalab.init()
    sh.run_line_magic("load_ext", "cudalab")
    yield sh
    sh.run_line_magic("unload_ext", "cudalab")


def run(sh, src):
    """Run a cell; (ExecutionResult, stdout with any traceback, [display text/plain...])."""
    with capture_output() as cap:
        r = sh.run_cell(src, store_history=True)
    return r, cap.stdout, [o.data.get("text/plain", "") for o in cap.outputs]


# =============================================================================== comments
@pytest.mark.parametrize("line, words", [
    ("snapshot   # segment map of the allocator", "snapshot"),
    ("snapshot a#b.pickle  # a # inside a word is not a comment", "snapshot a#b.pickle"),
    ('snapshot "run #2.pickle"  # quoted', 'snapshot "run #2.pickle"'),
    ("snapshot 'run #2.pickle'#x", "snapshot 'run #2.pickle'#x"),  # '#' inside the word
    ("snapshot run\\ #2.pickle", "snapshot run\\ #2.pickle"),  # an escaped space
    ("# all comment", ""),
    ("watch on --threshold 1MiB", "watch on --threshold 1MiB"),
])
def test_strip_comment(line, words):
    assert strip_comment(line).rstrip() == words


def test_memory_snapshot_with_a_trailing_comment_writes_no_file(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, out, _t = run(ip, "%cuda_memory snapshot   # segment map of the allocator")
    assert r.success, out
    assert not (tmp_path / "#").exists() and list(tmp_path.iterdir()) == []
    assert "wrote" not in out  # the viewer (or the dict), not a file
    close = getattr(r.result, "close", None)
    if close is not None:
        close()
    r, out, _t = run(ip, '%cuda_memory snapshot "run #2.pickle"  # a quoted path keeps its #')
    assert r.success and "wrote run #2.pickle" in out, out
    assert cm.load_snapshot(str(tmp_path / "run #2.pickle"))["segments"] is not None
    r, out, _t = run(ip, "%cuda_memory snapshot dict  # the dict")
    assert r.success and isinstance(r.result, dict)
    assert sorted(os.listdir(tmp_path)) == ["run #2.pickle"]


def test_memory_history_with_a_trailing_comment(ip, tmp_path):
    r, out, _t = run(ip, "%cuda_memory history start --max-entries 100  # record")
    try:
        assert r.success and "max_entries=100" in out, out
        path = tmp_path / "h #1.csv"
        r, out, _t = run(ip, f"%cuda_memory history save '{path}'  # CSV")
        assert r.success and path.stat().st_size > 0, out
    finally:
        run(ip, "%cuda_memory history stop")


@pytest.mark.parametrize("line, stmt", [
    ("-r 50  # GPU time of step()", ""),
    ("-r 5 x = '#a'  # the string keeps its #", "x = '#a'"),
    ("  # only a comment", ""),
    ("-q f(\"#\", 1)#x", 'f("#", 1)'),
    ("y = '#unterminated", "y = '#unterminated"),  # left for the compiler's error
])
def test_timed_options_strip_a_trailing_comment(line, stmt):
    assert parse_options(line).stmt == stmt


def test_timed_comment_is_not_a_statement(ip):
    run(ip, "calls_c_ = []")
    res = _timed(ip, "%%cuda_timed -n 1 -r 3 -w 0  # GPU time of the append\n"
                     "calls_c_.append(1)")
    assert res.repeats == 3 and ip.user_ns["calls_c_"] == [1, 1, 1]
    r, _o, _t = run(ip, "%%cuda_timed hash_ = '#'  # a setup statement with a comment\n"
                        "hash_ * 2")
    assert r.success and r.result == "##"
    r, _o, _t = run(ip, "%cuda_timed -r 3  # nothing to time")
    assert isinstance(r.error_in_exec, UsageError)
    assert "needs a statement" in str(r.error_in_exec)


def _timed(sh, src):
    line, _, body = src.partition("\n")
    head, _, rest = line.partition(" ")
    r, out, _t = run(sh, f"{head} -o -q {rest}\n{body}")
    assert r.success, out
    assert isinstance(r.result, CudaTimedResult)
    return r.result


# =============================================================================== bad paths
@pytest.mark.parametrize("line, reason", [
    ("history save {missing}/x.pickle", "does not exist"),
    ("history save {missing}/x.csv", "does not exist"),
    ("history save {missing}/x.json", "does not exist"),
    ("history save {dir}", "it is a directory"),
    ("snapshot {missing}/x.pickle", "does not exist"),
    ("snapshot {dir}", "it is a directory"),
    ("snapshot view {missing}/x.pickle", "no such file"),
    ("explore {missing}/x.pickle", "no such file"),
    ("explore {dir}", "it is a directory"),
    ("snapshot view {dir}", "it is a directory"),
    ("snapshot view {dir}/corrupt.pickle", "corrupt"),
])
def test_memory_bad_paths_are_one_line_usage_errors(ip, tmp_path, line, reason):
    (tmp_path / "corrupt.pickle").write_bytes(b"not a pickle")
    missing = tmp_path / "no" / "such"
    line = line.format(missing=missing, dir=tmp_path)
    path = line.split()[-1]
    r, out, _t = run(ip, f"%cuda_memory {line}")
    err = r.error_in_exec
    assert isinstance(err, UsageError), out
    assert path in str(err) and reason in str(err)
    assert "Traceback" not in out  # IPython prints a UsageError as one line
    assert not missing.parent.exists()


def test_memory_empty_path_is_a_usage_error(ip):
    for line in ("history save ''", "snapshot ''"):
        r, out, _t = run(ip, f"%cuda_memory {line}")
        assert isinstance(r.error_in_exec, UsageError), out


def test_memory_save_with_any_other_extension_writes_a_pickle(ip, tmp_path):
    """Not an error: anything but .csv/.json/.json.gz is a memory_viz pickle (as documented)."""
    path = tmp_path / "x.txt"
    r, out, _t = run(ip, f"%cuda_memory history save {path}")
    assert r.success and "snapshot pickle" in out
    with open(path, "rb") as f:
        assert "segments" in pickle.load(f)  # noqa: S301 - our own file


# =============================================================================== tracebacks
@pytest.mark.parametrize("cell", [
    "%%cuda_timed\nboom_()",
    "%%cuda_timed -n 2 -r 2\nboom_()",
    "%cuda_timed boom_()",
    "%cuda_timed -n 1 -r 2 boom_()",
    "%%cuda_timed\nraise ValueError('boom')",
])
def test_traceback_shows_no_magic_frames(ip, cell):
    run(ip, "def boom_():\n    raise ValueError('boom')")
    r, out, _t = run(ip, cell)
    assert isinstance(r.error_in_exec, ValueError)
    assert "ValueError: boom" in out
    assert "skipping hidden" in out
    for frame in ("cudalab/magics", "cudalab\\magics", "timed.py", "run_cuda_timed",
                  "_run_single", "_run_repeat"):
        assert frame not in out, out
    if "boom_()" in cell:
        assert "in boom_()" in out  # the user's own frames stay


# =============================================================================== Ctrl-C
@pytest.mark.parametrize("n", [1, 2])
def test_interrupt_reports_the_finished_repeats(ip, n):
    from cudalab._internal import launch_observers

    run(ip, "runs_i_ = [0]")
    # -n loops per repeat: the body raises in its first loop of repeat 3 (after 3 repeats)
    r, out, texts = run(ip, f"%%cuda_timed -n {n} -r 10 -w 0 -v res_i_\n"
                            "runs_i_[0] += 1\n"
                            f"if runs_i_[0] > 3 * {n}: raise KeyboardInterrupt")
    assert isinstance(r.error_in_exec, KeyboardInterrupt)  # the cell ends as interrupted
    assert "KeyboardInterrupt" in out
    res = ip.user_ns["res_i_"]
    assert res.repeats == 3 and res.count == 3 and res.loops == n
    assert res.gpu_times.shape == (1, 3)
    assert any("interrupted after 3 repeats" in w for w in res.warnings)
    assert "interrupted after 3 repeats" in "\n".join(texts)
    assert gc.isenabled() and not launch_observers
    # the events were given back: the next run works
    assert _timed(ip, "%cuda_timed -n 1 -r 2 -w 0 pass").count == 2


def test_interrupt_before_any_repeat_just_interrupts(ip):
    r, out, texts = run(ip, "%%cuda_timed -n 1 -r 5 -w 1\nraise KeyboardInterrupt")
    assert isinstance(r.error_in_exec, KeyboardInterrupt)
    assert texts == []  # warm-up: nothing measured, nothing to report


# =============================================================================== clocks
class _Ctx:
    def __init__(self, simulated):
        self.devs = [0]
        self.simulated = simulated
        self.hints: list[str] = []


def test_no_clock_locking_advice_on_the_simulator():
    magics = CudaLabMagics()
    before = {0: {"clock_rate": 345, "simulated": True}}
    after = {0: {"clock_rate": 1980, "simulated": True}}
    ctx = _Ctx(simulated=True)
    clock_hints(before, after, magics, ctx)
    assert not any("nvidia-smi" in h or "lock" in h for h in ctx.hints)
    ctx = _Ctx(simulated=False)  # a real GPU still gets the advice
    clock_hints({0: {"clock_rate": 345}}, {0: {"clock_rate": 1980}}, magics, ctx)
    assert any("nvidia-smi -lgc" in h for h in ctx.hints)


def test_first_timed_cell_on_the_simulator_gives_no_clock_advice(ip, monkeypatch):
    """The simulated SM clock jumps 345 -> 1980 MHz when work starts after a second idle, as
    in a notebook's first timed cell: the report gives no nvidia-smi advice."""
    if not cudalab.devices.backend().simulated:
        pytest.skip("simulator only")
    import cudalab.magics.timed as timed_mod

    clocks = iter([345, 1980])

    def nvml_context(devs):
        return {d: {"clock_rate": next(clocks), "temperature": 35, "power_draw": 70000,
                    "simulated": True, "reasons": None} for d in devs}

    monkeypatch.setattr(timed_mod, "nvml_context", nvml_context)
    r, _o, texts = run(ip, "%%cuda_timed\nx_c_ = 1")
    assert r.success and "345 → 1980 MHz" in texts[0]
    assert "nvidia-smi" not in texts[0] and "lock the clocks" not in texts[0]


# =============================================================================== docstring
def test_cuda_memory_docstring_lists_every_subcommand():
    doc = CudaLabMagics.cuda_memory.__doc__ or ""
    for word in ("--context", "--stacks", "--max-entries", "snapshot dict", "snapshot PATH",
                 "snapshot view", "history save PATH", "history frame"):
        assert word in doc, word
