"""``%cuda_memory history|snapshot ... --source cupy`` and ``cudalab what-if --source cupy``:
the CuPy recording driven from the magic, on the fake CuPy of
tests/helpers/fake_allocators.py (its pool calls CuPy's memory hooks)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import cudalab
from cudalab.memory_tools import cupy_history
from tests.helpers.fake_allocators import get_memory_hooks
from tests.helpers.shell import run_cell_printing as run


@pytest.fixture
def ip(shell, monkeypatch):
    monkeypatch.setattr(cupy_history, "_current", None)
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")
    rec = cupy_history.current_recording()
    if rec is not None and rec.active:
        rec.stop()


def test_history_of_cupy(ip, cupy, tmp_path):
    import pandas as pd

    from cudalab.memory import load_snapshot

    r, out = run(ip, "%cuda_memory history start --source cupy --context alloc --stacks python "
                     "--max-entries 1000")
    assert r.success and "recording CuPy's pool allocations with CuPy's memory hooks" in out
    assert "on thread 'MainThread' only (CuPy's hooks are per thread)" in out
    rec = cupy_history.current_recording()
    assert (rec.context, rec.stacks, rec.max_entries) == ("alloc", "python", 1000)
    run(ip, "h1_ = cupy.alloc(3 << 20); h2_ = cupy.alloc(1 << 20); cupy.free(h1_)")
    n = rec.entry_count()
    assert n == 6  # two segments, two allocations, a free's two entries
    r, out = run(ip, "%cuda_memory history frame --source cupy")
    assert len(r.result) == n and r.result.attrs["identity"]["allocator"] == "cupy"
    r, out = run(ip, "%cuda_memory history status --source cupy")
    assert "CuPy recording on thread 'MainThread'" in out and f"{n} trace entries held" in out
    r, out = run(ip, "%cuda_memory history start --source cupy")
    assert "being recorded already" in out
    ip.user_ns["hdir_"] = str(tmp_path)
    for name in ("h.pickle", "h.csv", "h.json"):
        r, out = run(ip, f"%cuda_memory history save {{hdir_}}/{name} --source cupy")
        assert r.success and f"wrote {n} CuPy trace entries" in out, out
    saved = load_snapshot(str(tmp_path / "h.pickle"))
    assert saved["identity"]["allocator"] == "cupy"
    assert [e["addr"] for e in saved["device_traces"][0]] == \
        [e[1] for e in rec.raw_entries(0)]
    assert len(pd.read_csv(tmp_path / "h.csv")) == n
    r, out = run(ip, "%cuda_memory history stop --source cupy")
    assert f"{n} trace entries kept" in out and not rec.active
    run(ip, "h3_ = cupy.alloc(1 << 20)")  # after the stop: not recorded
    r, out = run(ip, "%cuda_memory history frame --source cupy")
    assert len(r.result) == n


def test_snapshot_of_cupy_while_recording(ip, cupy, tmp_path):
    r, out = run(ip, "%cuda_memory snapshot dict --source cupy")
    assert isinstance(r.error_in_exec, UsageError)
    assert "start a recording first ('%cuda_memory history start --source cupy'" in \
        str(r.error_in_exec)
    run(ip, "%cuda_memory history start --source cupy")
    run(ip, "s1_ = cupy.alloc(2 << 20); s2_ = cupy.alloc(4000)")
    r, out = run(ip, "%cuda_memory snapshot dict --source cupy")
    assert repr(r.result).startswith("<cupy memory snapshot: 2 segments, 2 blocks")
    pool = cupy.get_default_memory_pool()
    (figures,) = r.result["cudalab"]["cupy_pool"]
    assert figures["used_bytes"] == pool.used_bytes() == figures["recorded_used_bytes"]
    ip.user_ns["spath_"] = str(tmp_path / "s.pickle")
    r, out = run(ip, "%cuda_memory snapshot {spath_} --source cupy")
    assert r.success and "cupy memory snapshot" in out
    pytest.importorskip("ipywidgets")
    r, out = run(ip, "%cuda_memory snapshot view --source cupy")
    assert r.result.snapshot["identity"]["allocator"] == "cupy"
    assert "only what was allocated since the recording started" in r.result._summary.value
    r.result.close()


def test_what_if_of_cupy_from_the_shell(ip, cupy, tmp_path, capsys):
    from cudalab import cli

    run(ip, "%cuda_memory history start --source cupy")
    run(ip, "w_ = [cupy.alloc(n << 20) for n in (1, 3, 2)]; cupy.free(w_[1]); "
            "w2_ = cupy.alloc(2 << 20)")
    ip.user_ns["wpath_"] = str(tmp_path / "w.pickle")
    run(ip, "%cuda_memory history save {wpath_} --source cupy")
    capsys.readouterr()
    assert cli.main(["what-if", str(tmp_path / "w.pickle"), "--source", "cupy",
                     "--conf", "expandable_segments:True"]) == 0
    out = capsys.readouterr().out
    assert "what-if:" in out and "expandable_segments:True" in out
    # the file is CuPy's, not torch's
    assert cli.main(["what-if", str(tmp_path / "w.pickle"), "--source", "torch"]) == 2
    assert "is cupy's trace (its identity says so)" in capsys.readouterr().err


def test_cupy_history_bad_input(ip, cupy):
    r, out = run(ip, "%cuda_memory history stop --source cupy")  # stop without start
    assert r.success and "CuPy is not being recorded" in out
    r, out = run(ip, "%cuda_memory history status --source cupy")
    assert "CuPy not recorded" in out
    for line in ("history save /tmp/x.pickle --source cupy", "history frame --source cupy"):
        r, out = run(ip, f"%cuda_memory {line}")
        assert isinstance(r.error_in_exec, UsageError)
        assert "no CuPy recording in this process" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory history save --source cupy")
    assert "history save PATH --source cupy" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory history start --source cupy --context sometimes")
    assert "context must be one of" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory history rewind --source cupy")
    assert "unknown action 'rewind'" in str(r.error_in_exec)


def test_cupy_backed_by_cudalab_is_refused_and_says_why(ip, cupy):
    from cudalab import interop

    cupy.cuda.set_allocator(interop.cupy_allocator)
    r, out = run(ip, "%cuda_memory history start --source cupy")
    assert isinstance(r.error_in_exec, UsageError)
    assert "cudalab's allocator backs CuPy" in str(r.error_in_exec)
    assert "'%cuda_memory history start'" in str(r.error_in_exec)


def test_the_recording_gone_is_reported(ip, cupy):
    """The user leaves CuPy's hook themselves: the magic's stop says stopped, never raises."""
    run(ip, "%cuda_memory history start --source cupy")
    run(ip, "g_ = cupy.alloc(1 << 20)")
    get_memory_hooks().pop(cupy_history.HOOK_NAME)
    r, out = run(ip, "g2_ = cupy.alloc(1 << 20)")  # not seen
    r, out = run(ip, "%cuda_memory history stop --source cupy")
    assert r.success and "2 trace entries kept" in out


def test_unload_stops_the_magics_recording(shell, cupy, monkeypatch):
    monkeypatch.setattr(cupy_history, "_current", None)
    shell.run_line_magic("load_ext", "cudalab")
    run(shell, "%cuda_memory history start --source cupy")
    rec = cupy_history.current_recording()
    shell.run_line_magic("unload_ext", "cudalab")
    assert not rec.active and cupy_history.HOOK_NAME not in get_memory_hooks()
