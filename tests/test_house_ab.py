"""benchmarks/house_ab.py, the before/after harness of the house's hot paths, runs on the
simulator (this checkout against itself, one quick round) and reports every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"allocator hit pair (alloc+delete, 4 KiB)", "Event.record", "launch: a += b (float32, 1024)",
        "launch: fill_ (int64, 1024, fill kernel)", "CUDAGraph.replay (one kernel)",
        'history stacks="python" (alloc+free pair)', "memory_stats()",
        # the simulator's two devices (CUDA_VISIBLE_DEVICES removed below): the collective rows
        "comm.broadcast (1 KiB, devices 0 and 1)", "comm.reduce_add (1 KiB, devices 0 and 1)",
        "comm.scatter (1 KiB, devices 0 and 1)", "comm.gather (1 KiB, devices 0 and 1)"}


def test_house_ab_times_every_row_on_both_sides(tmp_path):
    out = tmp_path / "ab.json"
    env = {**os.environ, "CUDALAB_SIMULATOR": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # (the simulator honours it: two devices here)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "house_ab.py"), str(ROOT),
                          "--rounds", "1", "--quick", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert set(result["table"]) == {f"cudalab {row}" for row in ROWS}, run.stdout
    assert all(r["before_us"] > 0 and r["after_us"] > 0 for r in result["table"].values())
    for side in ("before", "after"):
        (one,) = result["runs"][side]
        assert one["errors"] == {} and one["file"] == str(ROOT / "cudalab" / "__init__.py")
    assert "cudalab Event.record" in run.stdout and "ratio" in run.stdout
