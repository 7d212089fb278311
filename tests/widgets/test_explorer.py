"""The snapshot explorer widget (cudalab.widgets.explorer) and the user-frames-first stacks
of the snapshot viewer."""

from __future__ import annotations

from cudalab.memory_tools.synthetic import synthetic_snapshot
from cudalab.widgets import SnapshotViewer

IPY = [{"filename": "/venv/lib/python3.12/site-packages/IPython/core/interactiveshell.py",
        "line": 3577, "name": "run_code"},
       {"filename": "/venv/lib/python3.12/site-packages/ipykernel/kernelbase.py", "line": 9,
        "name": "dispatch_shell"}]
CELL = {"filename": "/tmp/ipykernel_7/11.py", "line": 2, "name": "<module>"}


def _with_notebook_frames(snap):
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                b["frames"] = [CELL, *IPY]
    for e in snap["device_traces"][0]:
        if e["frames"]:
            e["frames"] = [CELL, *IPY]
    return snap


def test_the_viewer_shows_user_frames_first_and_folds_the_kernel_frames():
    snap = _with_notebook_frames(synthetic_snapshot(400))
    v = SnapshotViewer(snap)
    seg = next(s for s in v.segments() if any(b["state"] != "inactive" for b in s["blocks"]))
    block = next(b for b in seg["blocks"] if b["state"] != "inactive")
    v._addr.value = hex(block["address"])
    detail = v._detail.value
    head, _, folded = detail.partition("<details")
    assert "11.py:2" in head and "run_code" not in head
    assert "2 IPython/ipykernel frames folded" in folded and "run_code" in folded
    # the map's tooltips name the user's frame, not IPython's
    assert "run_code" not in v._map.value and "11.py:2" in v._map.value
