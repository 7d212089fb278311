"""``run_lock.alone()`` (tests/helpers/alone.py): under pytest-xdist no other test runs while a
test is inside it; without the lock they do overlap (so the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_CONFTEST = """
import os
import pytest
from tests.helpers.alone import RunLock

@pytest.fixture(autouse=True)
def run_lock(tmp_path_factory):
    lock = RunLock(tmp_path_factory.getbasetemp().parent)
    yield lock
    lock.release()
"""

_TESTS = """
import contextlib, json, os, time
import pytest

def _span(name, seconds):
    t0 = time.time()
    time.sleep(seconds)
    with open(os.path.join(os.environ["SPANS"], f"{{name}}.json"), "w") as f:
        json.dump([t0, time.time()], f)

@pytest.mark.parametrize("i", range({n}))
def test_{name}(i, run_lock):
    time.sleep(0.05)  # (outside the block: the test runs beside others until it enters)
    with (run_lock.alone() if {alone} and not os.environ.get("ALONE_OFF") else contextlib.nullcontext()):
        _span(f"{name}{{i}}", {seconds})
"""


def _spans(where: Path, off: bool) -> tuple[list, list]:
    spans = where / ("spans_off" if off else "spans")
    spans.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "SPANS": str(spans)}
    env.pop("PYTEST_XDIST_WORKER", None)
    if off:
        env["ALONE_OFF"] = "1"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--rootdir", str(where), "--basetemp", str(where / ("tmp_off" if off else "tmp")),
                          str(where / "t")], cwd=where, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    alone = [json.loads(p.read_text()) for p in spans.glob("alone*.json")]
    others = [json.loads(p.read_text()) for p in spans.glob("other*.json")]
    assert len(alone) == 2 and len(others) == 12
    return alone, others


def _overlaps(alone: list, others: list) -> int:
    return sum(1 for a0, a1 in alone for o0, o1 in others if o0 < a1 and a0 < o1)


def test_an_alone_test_runs_with_no_other_beside_it(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (the dev extra brings it)")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "t" / "test_alone.py").write_text(_TESTS.format(name="alone", seconds=0.6, alone=True, n=2))
    (tmp_path / "t" / "test_other.py").write_text(_TESTS.format(name="other", seconds=0.15, alone=False, n=12))
    assert _overlaps(*_spans(tmp_path, off=False)) == 0
    assert _overlaps(*_spans(tmp_path, off=True)) > 0  # the check can fail
